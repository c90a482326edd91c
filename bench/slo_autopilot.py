"""The SLO autopilot under a rising load: attainment and throughput with it off and on.

Two tenants on one ``kvgate serve`` (SmolLM2 by default): "chat" (critical) keeps
``--chats`` short streaming requests in flight; "bulk" (batch) sends long prompts with a few
output tokens, at a concurrency that rises phase by phase (``--phases``, e.g. 0,1,2,4 then 0:
the load stops). The chat class has an inter-token p99 target and a TTFT p99 target, the bulk
class a TTFT p90 target. The same load runs twice, each on a fresh server: with the tenants
file's ``[slo]`` targets (autopilot on) and without them (off).

Reported per session: SLO attainment per class (the share of requests that met every target
of their class: a request's TTFT, and its own inter-token p99 = the largest of its gaps
below 100), output tokens/s of both tenants together, and, with the autopilot on, its
moves and the time it took to adapt (from the first window over a target to the first
window back within it, read from ``/dashboard/data``).

    python bench/slo_autopilot.py                       # 5 phases of 30 s
    python bench/slo_autopilot.py --phase-seconds 10    # a quick look

One client event loop serves both tenants (the rates are low: tens of events a second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Result, make_prompts, one_request, start_kvgate, wait_healthy

from kvgate.model.registry import DEFAULT_MODEL

TENANTS = """
admin_keys = ["sk-admin"]

[tenants.chat]
keys = ["sk-chat"]
priority = "critical"

[tenants.bulk]
keys = ["sk-bulk"]
priority = "batch"
"""
SLO = """
[slo]
window = {window}
recover_windows = 3

[slo.critical]
itl_p99 = {itl}
ttft_p99 = {ttft}

[slo.batch]
ttft_p90 = {bulk_ttft}
"""


def request_p99(result: Result) -> float:
    """A request's own inter-token p99 (nearest rank; its largest gap under 100 gaps)."""
    gaps = sorted(result.gaps)
    return gaps[max(math.ceil(0.99 * len(gaps)) - 1, 0)] if gaps else 0.0


async def closed_loop(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    prompts: list[str],
    output_len: int,
    concurrency: int,
    until: float,
    sink: list[tuple[float, Result]],
) -> None:
    """``concurrency`` requests in flight until ``until``; (send time, result) each."""

    async def worker(i: int) -> None:
        n = i
        while time.perf_counter() < until:
            sent = time.perf_counter()
            prompt = prompts[n % len(prompts)]
            n += concurrency
            result = await one_request(
                http, url, prompt, output_len, {"Authorization": f"Bearer {key}"}
            )
            sink.append((sent, result))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def watch(http: httpx.AsyncClient, url: str, until: float, log: list[dict[str, Any]]) -> None:
    """The autopilot's figures every 0.25 s (nothing when it is off)."""
    headers = {"Authorization": "Bearer sk-admin"}
    while time.perf_counter() < until:
        try:
            data = (await http.get(f"{url}/dashboard/data", headers=headers)).json()
        except httpx.HTTPError:
            data = {}
        slo = next(iter((data.get("slo") or {}).values()), None)
        if slo is not None:
            log.append({"t": time.perf_counter(), **slo})
        await asyncio.sleep(0.25)


async def session(url: str, args: argparse.Namespace) -> dict[str, Any]:
    chat_prompts = make_prompts(64, (20, 40), seed=1)
    bulk_prompts = make_prompts(64, (args.bulk_tokens, args.bulk_tokens + 50), seed=2)
    chats: list[tuple[float, Result]] = []
    bulks: list[tuple[float, Result]] = []
    watched: list[dict[str, Any]] = []
    phases = [int(p) for p in args.phases.split(",")]
    t0 = time.perf_counter()
    end = t0 + len(phases) * args.phase_seconds
    async with httpx.AsyncClient(timeout=600) as http:
        tasks = [
            closed_loop(
                http, url, "sk-chat", chat_prompts, args.chat_tokens, args.chats, end, chats
            ),
            watch(http, url, end, watched),
        ]
        for i, n in enumerate(phases):
            if n:
                start = t0 + i * args.phase_seconds
                tasks.append(_later(start, closed_loop(
                    http, url, "sk-bulk", bulk_prompts, args.bulk_output, n,
                    start + args.phase_seconds, bulks,
                )))  # fmt: skip
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {
        "chat": _attainment(chats, {"ttft": args.ttft, "itl": args.itl}),
        "bulk": _attainment(bulks, {"ttft": args.bulk_ttft}),
        "phases": [
            {
                "bulk_streams": n,
                "chat": _attainment(
                    [(s, r) for s, r in chats if _phase(s - t0, args.phase_seconds) == i],
                    {"ttft": args.ttft, "itl": args.itl},
                ),
            }
            for i, n in enumerate(phases)
        ],
        "output_tok_s": sum(r.output_tokens for _, r in (*chats, *bulks)) / wall,
        "errors": sum(1 for _, r in (*chats, *bulks) if not r.ok),
        "adapt_seconds": _adapt_times(watched, args.itl),
        "moves": _moves(watched),
    }


async def _later(at: float, coroutine: Any) -> None:
    await asyncio.sleep(max(at - time.perf_counter(), 0.0))
    await coroutine


def _phase(seconds: float, length: float) -> int:
    return int(seconds // length)


def _attainment(results: list[tuple[float, Result]], targets: dict[str, float]) -> dict[str, Any]:
    done = [r for _, r in results if r.ok]
    met = [
        r
        for r in done
        if r.ttft <= targets["ttft"] and ("itl" not in targets or request_p99(r) <= targets["itl"])
    ]
    return {
        "requests": len(done),
        "attainment": len(met) / len(done) if done else float("nan"),
    }


def _adapt_times(watched: list[dict[str, Any]], target: float) -> list[float]:
    """Seconds from each first window over the chat ITL target to the first back within it."""
    times: list[float] = []
    over_since: float | None = None
    last_windows = -1
    for row in watched:
        if row["windows"] == last_windows:
            continue  # the same window as the previous poll
        last_windows = row["windows"]
        observed = row["groups"].get("critical", {}).get("itl_p99", {}).get("observed")
        if observed is None:
            continue
        if observed > target and over_since is None:
            over_since = row["t"]
        elif observed <= target and over_since is not None:
            times.append(round(row["t"] - over_since, 2))
            over_since = None
    return times


def _moves(watched: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for row in watched:
        for move in row["recent"]:
            text = f"{move['direction']}: {move['reason']}"
            if not seen or seen[-1] != text:
                seen.append(text)
    # Consecutive polls repeat the same recent moves: keep the order of first sight.
    out: list[str] = []
    for text in seen:
        if text not in out[-5:]:
            out.append(text)
    return out


def run(args: argparse.Namespace, with_slo: bool, port: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        text = TENANTS
        if with_slo:
            text += SLO.format(
                window=args.window, itl=args.itl, ttft=args.ttft, bulk_ttft=args.bulk_ttft
            )
        tenants.write_text(text)
        server = start_kvgate(
            "kvgate", args.model, port, args.threads, args.max_num_seqs,
            "--tenants", str(tenants), "--max-num-batched-tokens", str(args.budget),
        )  # fmt: skip
        try:
            wait_healthy(server)
            return asyncio.run(session(server.url, args))
        finally:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--phases", default="0,1,2,4,0", help="bulk streams in each phase")
    p.add_argument("--phase-seconds", type=float, default=30.0)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--bulk-tokens", type=int, default=1500, help="bulk prompt length")
    p.add_argument("--bulk-output", type=int, default=8)
    p.add_argument("--itl", type=float, default=0.2, help="chat inter-token p99 target, s")
    p.add_argument("--ttft", type=float, default=1.0, help="chat TTFT p99 target, s")
    p.add_argument("--bulk-ttft", type=float, default=30.0, help="bulk TTFT p90 target, s")
    p.add_argument("--window", type=float, default=2.0)
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    results = {}
    for name, with_slo in (("off", False), ("on", True)):
        results[name] = run(args, with_slo, args.port)
        r = results[name]
        print(
            f"autopilot {name}: chat attainment {r['chat']['attainment']:.2f} "
            f"({r['chat']['requests']} requests), bulk {r['bulk']['attainment']:.2f} "
            f"({r['bulk']['requests']}), {r['output_tok_s']:.1f} output tok/s, "
            f"{r['errors']} errors",
            flush=True,
        )
        for i, ph in enumerate(r["phases"]):
            print(
                f"  phase {i} ({ph['bulk_streams']} bulk streams): chat attainment "
                f"{ph['chat']['attainment']:.2f} of {ph['chat']['requests']}"
            )
        if with_slo:
            print(f"  time to adapt (s): {r['adapt_seconds']}")
            for move in r["moves"]:
                print(f"  {move}")
    off, on = results["off"], results["on"]
    ratio = on["output_tok_s"] / off["output_tok_s"]
    print(
        f"on / off: chat attainment {on['chat']['attainment']:.2f} / "
        f"{off['chat']['attainment']:.2f}, throughput {ratio:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), **results}, default=str, indent=1))


if __name__ == "__main__":
    main()
