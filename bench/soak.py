"""Soak: ``kvgate serve`` under mixed load for a long time; does anything leak or go missing?

One server (SmolLM2 by default, a tenants file, its own usage ledger) gets, for ``--minutes``,
a mix from ``--clients`` concurrent clients, each request picked at random:

- ``stream``: a streamed chat, read to the end (``include_usage``);
- ``plain``: a non-streamed completion;
- ``disconnect``: a streamed completion the client drops after a few chunks;
- ``abort``: a non-streamed completion the client gives up on after a short timeout;
- ``flood``: a request of the ``bursty`` tenant, whose ``requests_per_minute`` is low, so
  most are refused with 429;
- ``invalid``: a malformed request (400).

Reported at the end (and as JSON with ``--out``): the server's RSS after warm-up and at the
end (and its peak), KV blocks still held once the server is idle (a leak if not 0), engine
restarts, the client's responses by status and error code, and the usage ledger
(``GET /admin/usage``) against the client's own count: one record per request that received
tokens, none for one that received nothing, and equal token counts where the client read
the whole response.

    python bench/soak.py                      # 30 minutes, 6 clients
    python bench/soak.py --minutes 3 --clients 4 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvgate.model import cpu_isa

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"steady": "sk-soak-steady", "bursty": "sk-soak-bursty"}
ADMIN_KEY = "sk-soak-admin"
TENANTS = f"""
admin_keys = ["{ADMIN_KEY}"]

[tenants.steady]
keys = ["{KEYS["steady"]}"]

[tenants.bursty]
keys = ["{KEYS["bursty"]}"]
requests_per_minute = 6
"""
KINDS = {"stream": 35, "plain": 20, "disconnect": 15, "abort": 10, "flood": 15, "invalid": 5}
WORDS = ("the", "river", "carried", "light", "through", "valley", "while", "engineers",
         "measured", "how", "memory", "moved", "across", "cache", "and", "every", "tenant",
         "waited", "its", "turn", "at", "door", "of", "a", "busy", "server")  # fmt: skip


@dataclass
class Outcome:
    """What the client saw of one request."""

    request_id: str
    kind: str
    tenant: str
    status: int = 0  # 0: no response (transport error, or the client gave up)
    code: str = ""  # the error's code, for non-200 responses
    received_tokens: bool = False  # any generated text reached the client
    complete: bool = False  # read to the end, with the server's usage
    prompt_tokens: int = 0
    completion_tokens: int = 0  # from the server's usage (complete) or chunks seen


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))


async def one(
    http: httpx.AsyncClient, url: str, kind: str, rid: str, rng: random.Random
) -> Outcome:
    tenant = "bursty" if kind == "flood" else "steady"
    out = Outcome(rid, kind, tenant)
    headers = {"authorization": f"Bearer {KEYS[tenant]}", "x-request-id": rid}
    max_tokens = rng.randint(8, 48)
    if kind == "stream":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": prompt(rng)}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
    elif kind == "invalid":
        path, body = "/v1/completions", {"prompt": prompt(rng), "max_tokens": -3}
    else:
        path = "/v1/completions"
        stream = kind == "disconnect"
        body = {"prompt": prompt(rng), "max_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
    timeout = rng.uniform(0.05, 0.5) if kind == "abort" else 300.0
    drop_after = rng.randint(1, 4)
    try:
        async with http.stream(
            "POST", url + path, json=body, headers=headers, timeout=timeout
        ) as r:
            out.status = r.status_code
            if r.status_code != 200:
                error = json.loads(await r.aread()).get("error", {})
                out.code = str(error.get("code") or error.get("type"))
                return out
            if not body.get("stream"):
                data = json.loads(await r.aread())
                out.received_tokens = out.complete = True
                out.prompt_tokens = data["usage"]["prompt_tokens"]
                out.completion_tokens = data["usage"]["completion_tokens"]
                return out
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    out.complete = True
                    out.prompt_tokens = event["usage"]["prompt_tokens"]
                    out.completion_tokens = event["usage"]["completion_tokens"]
                for c in event.get("choices", []):
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        out.received_tokens = True
                        chunks += 1
                if kind == "disconnect" and chunks >= drop_after:
                    out.completion_tokens = chunks
                    return out  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException:
        out.code = "client_timeout"
    except httpx.HTTPError as exc:
        out.code = type(exc).__name__
    return out


async def load(url: str, minutes: float, clients: int, seed: int) -> list[Outcome]:
    end = time.monotonic() + minutes * 60
    outcomes: list[Outcome] = []
    kinds, weights = list(KINDS), list(KINDS.values())
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)

    async def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        n = 0
        async with httpx.AsyncClient(limits=limits) as http:
            while time.monotonic() < end:
                kind = rng.choices(kinds, weights)[0]
                outcomes.append(await one(http, url, kind, f"soak-{seed}-{c}-{n}", rng))
                n += 1

    await asyncio.gather(*(client(c) for c in range(clients)))
    return outcomes


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str, timeout: float = 60) -> float:
    """Seconds until no request runs or waits (the engine's own gauges)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        busy = metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")
        if busy == 0:
            return time.monotonic() - start
        time.sleep(0.5)
    return float("inf")


def check_ledger(url: str, since: float, outcomes: list[Outcome]) -> dict[str, Any]:
    """The ledger against the client's count, request by request (by x-request-id)."""
    got = httpx.get(
        url + "/admin/usage", params={"since": since},
        headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60,
    ).json()  # fmt: skip
    records: dict[str, list[dict[str, Any]]] = {}
    for rec in got["records"]:
        records.setdefault(rec["request_id"], []).append(rec)
    report: Counter[str] = Counter()
    mismatches: list[str] = []
    for o in outcomes:
        recs = records.pop(o.request_id, [])
        if len(recs) > 1:
            report["duplicate_records"] += 1
            mismatches.append(f"{o.request_id}: {len(recs)} records")
        if o.received_tokens:
            if not recs:
                report["missing_records"] += 1
                mismatches.append(f"{o.request_id} ({o.kind}): received tokens, no record")
                continue
            rec = recs[0]
            if o.complete:
                same = (rec["prompt_tokens"], rec["completion_tokens"]) == (
                    o.prompt_tokens, o.completion_tokens,
                )  # fmt: skip
                report["complete_equal" if same else "complete_differ"] += 1
                if not same:
                    mismatches.append(
                        f"{o.request_id} ({o.kind}): client {o.prompt_tokens}+"
                        f"{o.completion_tokens}, ledger {rec['prompt_tokens']}+"
                        f"{rec['completion_tokens']}"
                    )
            else:  # dropped mid-stream: billed at least what the client saw
                ok = rec["completion_tokens"] >= o.completion_tokens
                report["partial_billed_at_least_seen" if ok else "partial_under_billed"] += 1
        elif recs:
            # Nothing reached this client; a record means the server delivered (a whole
            # response written as the client gave up): counted apart, not an error by itself.
            report[f"record_without_tokens_seen:{o.kind}"] += 1
    report["records_of_unknown_requests"] = len(records)
    return {
        "checks": dict(report), "mismatches": mismatches[:20], "ledger_totals": got["totals"],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("serve_args", nargs="*", help="extra kvgate serve flags (after --)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    (tmp / "tenants.toml").write_text(TENANTS)
    cmd = [
        sys.executable, "-m", "kvgate.entrypoints.cli", "serve", "--port", str(args.port),
        "--threads", str(args.threads), "--max-num-seqs", "8", "--kv-cache-memory", "256MiB",
        "--tenants", str(tmp / "tenants.toml"), "--usage-db", str(tmp / "usage.sqlite3"),
        "--access-log", "", "--log-level", "warning", *args.serve_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvgate did not start (exit {proc.returncode})")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        # Warm-up (first-call allocations), then the baseline RSS.
        asyncio.run(load(url, 0.25, args.clients, seed=10_000 + args.seed))
        wait_idle(url)
        since = time.time()
        rss_start = rss_kib(proc.pid)
        peak = rss_start
        print(f"cpu: {cpu_isa.describe_cpu()}\nserver pid {proc.pid}, RSS after warm-up "
              f"{rss_start / 1024:.0f} MiB; load for {args.minutes} min", flush=True)  # fmt: skip

        async def sampled() -> list[Outcome]:
            nonlocal peak
            task = asyncio.create_task(load(url, args.minutes, args.clients, args.seed))
            while not task.done():
                await asyncio.sleep(5)
                peak = max(peak, rss_kib(proc.pid))
            return await task

        started = time.monotonic()
        outcomes = asyncio.run(sampled())
        wall = time.monotonic() - started
        idle_after = wait_idle(url)
        time.sleep(1.0)  # the ledger's writer flushes within its flush interval
        report = {
            "cpu": cpu_isa.describe_cpu(),
            "minutes": round(wall / 60, 2),
            "clients": args.clients,
            "requests": len(outcomes),
            "by_kind": dict(Counter(o.kind for o in outcomes)),
            "responses": dict(Counter(f"{o.status} {o.code}".strip() for o in outcomes)),
            "rss_mib": {
                "after_warmup": round(rss_start / 1024, 1),
                "end": round(rss_kib(proc.pid) / 1024, 1),
                "peak": round(peak / 1024, 1),
            },
            "idle_after_s": round(idle_after, 2),
            "kv_blocks_used_when_idle": metric(url, "kvgate:kv_cache_blocks", 'state="used"'),
            "engine_restarts": metric(url, "kvgate:engine_restarts_total"),
            "ledger": check_ledger(url, since, outcomes),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    ledger = report["ledger"]["checks"]
    bad = (
        report["kv_blocks_used_when_idle"] != 0
        or report["engine_restarts"] != 0
        or any(ledger.get(k) for k in ("duplicate_records", "missing_records",
                                       "complete_differ", "partial_under_billed"))
    )  # fmt: skip
    print("SOAK " + ("FAILED" if bad else "PASSED"))
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
