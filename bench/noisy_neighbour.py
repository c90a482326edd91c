"""The noisy-neighbour scenario (shared/brief/bench.md): does a quiet tenant keep its latency
while a flooder saturates the same engine, and does the flooder still get the capacity?

Two tenants on one ``kvgate serve``: "quiet" sends a streaming request at a steady low rate
(TTFT is what it feels); "flooder" keeps many times the engine's batch in flight (closed loop,
``--flood-concurrency`` requests, each replaced the moment it ends), far more than the engine
can run at once. Each tenant is a client process of its own, as in production: one event
loop serving both let the flooder's responses delay the reading of the quiet tenant's first
token (once by 85 ms after the server had sent it). Three sessions, each on a fresh server:

1. quiet solo: the quiet tenant alone (its TTFT baseline);
2. tenant-fair scheduling (``--scheduling fair``, the default): the flooder alone for
   ``--alone`` seconds, then both tenants for ``--duration``, then the flooder alone again;
3. the same under plain FIFO (``--scheduling fifo``), for contrast.

Reported: the quiet tenant's TTFT p50/p99 against its solo run (target p99 <= 1.25x), and the
flooder's output tokens/s with both tenants against its capacity alone (target >= 90%; nothing
is refused or thrown away: the queue is long enough to hold every flooder request). The
capacity is the mean of the two windows alone on the same server: the machine drifts by
several percent over minutes, and one fresh server runs a few percent faster than another
(memory layout), so a capacity measured on another server, minutes earlier, moves the ratio
by as much as the effect measured. For each window the engine's step time by kind and its
preemptions are printed, from /metrics.

    python bench/noisy_neighbour.py                     # 120 s mixed phases
    python bench/noisy_neighbour.py --duration 30       # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Result, make_prompts, one_request, pct, start_kvgate, wait_healthy

TENANTS = """
[tenants.quiet]
keys = ["sk-quiet"]
kv_guaranteed = 0.1

[tenants.flooder]
keys = ["sk-flooder"]
"""
QUIET = {"Authorization": "Bearer sk-quiet"}
FLOODER = {"Authorization": "Bearer sk-flooder"}


@dataclass
class Flood:
    """Completed flooder requests as (start, end, output tokens)."""

    spans: list[tuple[float, float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def tokens_in(self, t0: float, t1: float) -> float:
        """Output tokens delivered in [t0, t1], a request's tokens spread over its lifetime."""
        total = 0.0
        for start, end, tokens in self.spans:
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0:
                total += tokens * overlap / max(end - start, 1e-9)
        return total


async def flood(
    url: str, prompts: list[str], output_len: int, concurrency: int, stop: asyncio.Event
) -> Flood:
    out = Flood()
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:

        async def worker(w: int) -> None:
            rng = random.Random(w)
            while not stop.is_set():
                body = {
                    "prompt": rng.choice(prompts),
                    "max_tokens": output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                start = time.monotonic()
                try:
                    r = await http.post(f"{url}/v1/completions", json=body, headers=FLOODER)
                except httpx.HTTPError as exc:
                    out.errors.append(repr(exc))
                    continue
                if r.status_code != 200:
                    out.errors.append(f"HTTP {r.status_code}: {r.text[:120]}")
                    await asyncio.sleep(0.1)
                    continue
                tokens = r.json()["usage"]["completion_tokens"]
                out.spans.append((start, time.monotonic(), tokens))

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return out


def flood_process(
    url: str,
    prompts: list[str],
    output_len: int,
    concurrency: int,
    stop: EventType,
    results: Queue[Flood],
) -> None:
    """The flooder as a client process of its own, as it would be in production: its
    responses (~16/s) then never hold up the event loop that times the quiet tenant's first
    token. Floods until ``stop`` is set; each in-flight request is let finish."""

    async def run() -> Flood:
        done = asyncio.Event()
        task = asyncio.create_task(flood(url, prompts, output_len, concurrency, done))
        await asyncio.to_thread(stop.wait)
        done.set()
        return await task

    results.put(asyncio.run(run()))


async def quiet(
    url: str, prompts: list[str], output_len: int, rate: float, duration: float
) -> list[Result]:
    """Steady arrivals, one every 1/rate seconds, for ``duration``."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        tasks = []
        start = time.monotonic()
        for i, p in enumerate(prompts):
            delay = start + i / rate - time.monotonic()
            if i / rate >= duration:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            headers = {**QUIET, "x-request-id": f"quiet-{i}"}  # found in the access log
            tasks.append(asyncio.create_task(one_request(http, url, p, output_len, headers)))
        return list(await asyncio.gather(*tasks))


@dataclass
class Window:
    """One measured span of a session: what the flooder got, what the quiet tenant felt,
    and where the engine's time went."""

    title: str
    t0: float
    t1: float
    engine: dict[str, float]
    quiet: list[Result] = field(default_factory=list)

    def report(self, flood: Flood | None, logged: dict[str, dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"window_s": self.t1 - self.t0, "engine": self.engine}
        if flood is not None:
            out["flood_tok_s"] = flood.tokens_in(self.t0, self.t1) / (self.t1 - self.t0)
        if self.quiet:
            ok = [r for r in self.quiet if r.ok]
            ttft = [r.ttft for r in ok]
            out.update(
                quiet_requests=len(self.quiet),
                quiet_failed=len(self.quiet) - len(ok),
                ttft_p50=pct(ttft, 50),
                ttft_p90=pct(ttft, 90),
                ttft_p99=pct(ttft, 99),
                itl_p50=pct([g for r in ok for g in r.gaps], 50),
                ttfts=[round(r.ttft, 4) if r.ok else None for r in self.quiet],
                slowest=slowest(self.quiet, logged),
                **delivery_gap(self.quiet, logged),
            )
        return out


def slowest(results: list[Result], logged: dict[str, dict[str, Any]], k: int = 3) -> list[Any]:
    """The ``k`` slowest first tokens, each beside the server's own timeline of that request
    (its access-log line): whether the time went to waiting, to the prefill, or to getting
    the token to the client."""
    order = sorted(range(len(results)), key=lambda i: -results[i].ttft)[:k]
    out = []
    for i in order:
        line = logged.get(f"quiet-{i}", {})
        keys = ("prompt_tokens", "door_s", "queue_s", "prefill_s", "ttft_s", "first_byte_s")
        timeline = {key: line.get(key) for key in keys}
        out.append({"request": i, "ttft": round(results[i].ttft, 4), **timeline})
    return out


def delivery_gap(results: list[Result], logged: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The client's time to first token less the server's (its access log: arrival to the
    first token handed to the connection), p50 and p99 over the quiet tenant's requests:
    the time the first token spent between the engine and the client's socket."""
    gaps, outside, wire = [], [], []
    for i, r in enumerate(results):
        line = logged.get(f"quiet-{i}", {})
        if not r.ok or line.get("ttft_s") is None:
            continue
        gaps.append(r.ttft - line["ttft_s"])
        if line.get("first_byte_s") is not None:  # sent by the server, not yet read
            wire.append(r.ttft - line["first_byte_s"])
        if line.get("queue_s") is not None and line.get("prefill_s") is not None:
            # Outside the engine's own timeline (queued, then prefilled) altogether.
            outside.append(r.ttft - line["queue_s"] - line["prefill_s"])
    if not gaps:
        return {}
    out = {"gap_p50": pct(gaps, 50), "gap_p99": pct(gaps, 99), "gap_n": float(len(gaps))}
    if outside:
        out.update(outside_engine_p50=pct(outside, 50), outside_engine_p99=pct(outside, 99))
    if wire:
        out.update(after_send_p50=pct(wire, 50), after_send_p99=pct(wire, 99))
    return out


def access_lines(path: Path) -> dict[str, dict[str, Any]]:
    """The quiet tenant's lines of a server's JSON-lines access log, by request id."""
    lines = {}
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if str(line.get("request_id", "")).startswith("quiet-"):
            lines[line["request_id"]] = line
    return lines


async def session(
    url: str, a: argparse.Namespace, *, with_flood: bool, duration: float, access_log: Path
) -> dict[str, dict[str, Any]]:
    """On one server: the quiet tenant for ``duration``; with the flooder, the flooder alone
    for ``--alone`` seconds before and after that (its capacity, on the same server and
    close in time, so the machine's drift and a server's luck of memory layout cancel)."""
    flood_prompts = make_prompts(64, tuple(a.prompt_len), seed=1)
    quiet_prompts = make_prompts(int(duration * a.quiet_rate) + 1, tuple(a.prompt_len), seed=2)
    windows: list[Window] = []

    async def measure(title: str, with_quiet: bool, seconds: float) -> None:
        before = await asyncio.to_thread(engine_summary, url)
        t0 = time.monotonic()
        results = []
        if with_quiet:
            results = await quiet(url, quiet_prompts, a.quiet_output_len, a.quiet_rate, seconds)
        else:
            await asyncio.sleep(seconds)
        t1 = time.monotonic()
        after = await asyncio.to_thread(engine_summary, url)
        engine = {k: v - before.get(k, 0.0) for k, v in after.items()}
        windows.append(Window(title, t0, t1, engine, results))

    fl = None
    if with_flood:
        spawn = multiprocessing.get_context("spawn")
        stop, results = spawn.Event(), spawn.Queue()
        flooder = spawn.Process(
            target=flood_process,
            args=(url, flood_prompts, a.flood_output_len, a.flood_concurrency, stop, results),
            daemon=True,
        )
        flooder.start()
        await asyncio.sleep(a.warmup)  # the queue fills; steady state before measuring
        await measure("flooder alone, before", False, a.alone)
        await measure("both", True, duration)
        await measure("flooder alone, after", False, a.alone)
        stop.set()
        fl = await asyncio.to_thread(results.get)
        flooder.join()
    else:
        await measure("quiet alone", True, duration)
    logged = access_lines(access_log)
    out = {w.title: w.report(fl, logged) for w in windows}
    if fl is not None:
        out["flood"] = {"requests": len(fl.spans), "refused": len(fl.errors)}
        out["flood"]["errors"] = sorted(set(fl.errors))[:3]
    return out


def engine_summary(url: str) -> dict[str, float]:
    """Where the engine's time has gone, from /metrics: step seconds and counts by phase
    (an urgent prefill's time is also inside the step it interrupted), and preemptions by
    cause. Read at both ends of the measured window."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        is_step = line.startswith("kvgate:engine_step_seconds_")
        if is_step and ("_sum{" in line or "_count{" in line):
            kind = "s" if "_sum{" in line else "n"
            phase = line.split('phase="')[1].split('"')[0]
            out[f"step_{kind}_{phase}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvgate:preemptions_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[f"preempt_{reason}"] = float(line.rsplit(" ", 1)[1])
    return out


def run_session(
    a: argparse.Namespace, tenants: Path, scheduling: str, engine_process: str, **kw: Any
) -> dict[str, dict[str, Any]]:
    log = Path(tempfile.mkstemp(suffix=".jsonl", dir=tenants.parent)[1])
    server = start_kvgate(
        f"kvgate-{scheduling}", 8411, a.threads, a.max_num_seqs,
        "--tenants", str(tenants), "--scheduling", scheduling, "--max-queue-len", "100000",
        "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--access-log", str(log),
        "--engine-process", engine_process,
        # Both tenants' clients come from 127.0.0.1: room for the flood and the quiet one.
        "--max-connections-per-client", str(a.flood_concurrency + 128), *a.server_args.split(),
    )  # fmt: skip
    try:
        wait_healthy(server)
        warm = make_prompts(4, (16, 32), seed=99)

        async def warmup() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                await asyncio.gather(*(one_request(http, server.url, p, 8, QUIET) for p in warm))

        asyncio.run(warmup())
        return asyncio.run(session(server.url, a, access_log=log, **kw))
    finally:
        server.stop()


def print_window(title: str, r: dict[str, Any]) -> None:
    line = f"  {title:<24}"
    if "ttft_p99" in r:
        p50, p99 = r["ttft_p50"] * 1000, r["ttft_p99"] * 1000
        line += (
            f" quiet TTFT p50 {p50:6.0f} ms p99 {p99:6.0f} ms "
            f"({r['quiet_requests']} req, {r['quiet_failed']} failed)"
        )
        if "gap_p99" in r:
            line += (
                f"; server-to-client gap p50 {r['gap_p50'] * 1000:.0f} ms "
                f"p99 {r['gap_p99'] * 1000:.0f} ms"
            )
        if "outside_engine_p99" in r:
            line += (
                f"; outside the engine's timeline p50 {r['outside_engine_p50'] * 1000:.0f} ms "
                f"p99 {r['outside_engine_p99'] * 1000:.0f} ms"
            )
        if "after_send_p99" in r:
            line += (
                f"; sent to read by the client p50 {r['after_send_p50'] * 1000:.0f} ms "
                f"p99 {r['after_send_p99'] * 1000:.0f} ms"
            )
    if "flood_tok_s" in r:
        line += f" | flooder {r['flood_tok_s']:6.1f} tok/s"
    print(line, flush=True)
    eng = r["engine"]
    steps = ", ".join(
        f"{k[7:]} {eng[k]:.1f} s / {eng['step_n_' + k[7:]]:.0f}"
        for k in sorted(eng)
        if k.startswith("step_s_") and eng["step_n_" + k[7:]]
    )
    preempt = ", ".join(
        f"{k[8:]} {v:.0f}" for k, v in sorted(eng.items()) if k.startswith("preempt_") and v
    )
    print(
        f"  {'':<24} in {r['window_s']:.0f} s, engine steps: {steps}; "
        f"preemptions: {preempt or 'none'}",
        flush=True,
    )
    if r.get("slowest"):

        def ms(v: float | None) -> str:
            return "?" if v is None else f"{v * 1000:.0f}"

        slow = "; ".join(
            f"#{x['request']} {ms(x['ttft'])} ms ({x['prompt_tokens']} tokens; server: door "
            f"{ms(x.get('door_s'))}, then queued {ms(x['queue_s'])}, prefill "
            f"{ms(x['prefill_s'])}, first token {ms(x['ttft_s'])}; first byte sent at "
            f"{ms(x.get('first_byte_s'))} after arrival)"
            for x in r["slowest"]
        )
        print(f"  {'':<24} slowest first tokens: {slow}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=120.0, help="seconds with both tenants")
    ap.add_argument(
        "--alone", type=float, default=30.0, help="seconds of flooder alone before and after"
    )
    ap.add_argument(
        "--solo-duration",
        type=float,
        default=None,
        help="seconds of the quiet tenant alone; default --duration, so that both runs send "
        "the very same prompts (a p99 is decided by the longest few)",
    )
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--quiet-rate", type=float, default=1.0, help="quiet requests per second")
    ap.add_argument("--quiet-output-len", type=int, default=32)
    ap.add_argument("--flood-output-len", type=int, default=64)
    ap.add_argument("--flood-concurrency", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--engine-process",
        choices=["off", "on", "both"],
        default="off",
        help="the servers' --engine-process; both: the tenant-fair session once each way",
    )
    ap.add_argument("--no-fifo", action="store_true", help="skip the FIFO session")
    ap.add_argument("--server-args", default="", help="more kvgate serve options")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.solo_duration is None:
        a.solo_duration = a.duration

    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(TENANTS)
        print(
            f"{a.threads} threads, max_num_seqs {a.max_num_seqs}; quiet: {a.quiet_rate:g} req/s "
            f"streaming, {a.quiet_output_len} tokens; flooder: {a.flood_concurrency} in flight, "
            f"{a.flood_output_len} tokens; prompts {a.prompt_len[0]}-{a.prompt_len[1]} tokens",
            flush=True,
        )
        report: dict[str, dict[str, dict[str, Any]]] = {}
        ways = ["off", "on"] if a.engine_process == "both" else [a.engine_process]
        plan = [("quiet alone", "fair", ways[0], False, a.solo_duration)]
        for way in ways:
            suffix = f", engine process {way}" if len(ways) > 1 else ""
            plan.append((f"tenant-fair (--scheduling fair){suffix}", "fair", way, True, a.duration))
        if not a.no_fifo:
            plan.append(("FIFO (--scheduling fifo)", "fifo", ways[0], True, a.duration))
        for title, scheduling, way, with_flood, duration in plan:
            print(f"{title}, a fresh server (--engine-process {way}):", flush=True)
            r = run_session(a, tenants, scheduling, way, with_flood=with_flood, duration=duration)
            for name, window in r.items():
                if name != "flood":
                    print_window(name, window)
            if "flood" in r:
                print(f"  flooder: {r['flood']['refused']} requests refused", flush=True)
            report[title] = r

    solo = report["quiet alone"]["quiet alone"]["ttft_p99"]
    print("\nratios (the flooder's capacity: the mean of its two windows alone on the same server)")
    verdict = {}
    for title in [t for t in report if t != "quiet alone"]:
        r = report[title]
        alone = [
            r["flooder alone, before"]["flood_tok_s"],
            r["flooder alone, after"]["flood_tok_s"],
        ]
        cap = sum(alone) / 2
        share = r["both"]["flood_tok_s"] / cap
        ttft = r["both"]["ttft_p99"] / solo
        verdict[title] = (ttft, share)
        print(
            f"  {title:<32} quiet TTFT p99 {ttft:6.2f}x solo | flooder {share * 100:5.1f}% of "
            f"capacity ({r['both']['flood_tok_s']:.1f} of {cap:.1f} tok/s; alone "
            f"{alone[0]:.1f} before, {alone[1]:.1f} after)"
        )
    for title, (ttft, share) in verdict.items():
        if not title.startswith("tenant-fair"):
            continue
        print(
            f"targets ({title}): quiet TTFT p99 <= 1.25x solo "
            f"({'met' if ttft <= 1.25 else 'NOT met'}), flooder >= 90% of "
            f"capacity ({'met' if share >= 0.9 else 'NOT met'})"
        )
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
