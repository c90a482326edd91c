"""The noisy-neighbour scenario (shared/brief/bench.md): does a quiet tenant keep its latency
while a flooder saturates the same engine, and does the flooder still get the capacity?

Two tenants on one ``kvgate serve``: "quiet" sends a streaming request at a steady low rate
(TTFT is what it feels); "flooder" keeps many times the engine's batch in flight (closed loop,
``--flood-concurrency`` requests, each replaced the moment it ends), far more than the engine
can run at once. Phases, each on a fresh server:

1. capacity: the flooder alone (tenant-fair server);
2. quiet solo: the quiet tenant alone;
3. mixed, tenant-fair scheduling (``--scheduling fair``, the default);
4. mixed, plain FIFO (``--scheduling fifo``) for contrast.

Reported: the quiet tenant's TTFT p50/p99 against its solo run (target p99 <= 1.25x), and the
flooder's output tokens/s against the capacity run (target >= 90%; nothing is refused or
thrown away: the queue is long enough to hold every flooder request).

    python bench/noisy_neighbour.py                     # 120 s mixed phases
    python bench/noisy_neighbour.py --duration 30       # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
                start = time.perf_counter()
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
                out.spans.append((start, time.perf_counter(), tokens))

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return out


async def quiet(
    url: str, prompts: list[str], output_len: int, rate: float, duration: float
) -> list[Result]:
    """Steady arrivals, one every 1/rate seconds, for ``duration``."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        tasks = []
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            delay = start + i / rate - time.perf_counter()
            if i / rate >= duration:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(http, url, p, output_len, QUIET)))
        return list(await asyncio.gather(*tasks))


async def phase(
    url: str,
    a: argparse.Namespace,
    *,
    with_flood: bool,
    with_quiet: bool,
    duration: float,
) -> dict[str, Any]:
    flood_prompts = make_prompts(64, tuple(a.prompt_len), seed=1)
    quiet_prompts = make_prompts(int(duration * a.quiet_rate) + 1, tuple(a.prompt_len), seed=2)
    stop = asyncio.Event()
    flood_task = None
    if with_flood:
        flood_task = asyncio.create_task(
            flood(url, flood_prompts, a.flood_output_len, a.flood_concurrency, stop)
        )
        await asyncio.sleep(a.warmup)  # the queue fills; steady state before measuring
    t0 = time.perf_counter()
    if with_quiet:
        results = await quiet(url, quiet_prompts, a.quiet_output_len, a.quiet_rate, duration)
    else:
        results = []
        await asyncio.sleep(duration)
    t1 = time.perf_counter()
    out: dict[str, Any] = {"window_s": t1 - t0}
    if flood_task is not None:
        stop.set()
        fl = await flood_task
        out["flood_tok_s"] = fl.tokens_in(t0, t1) / (t1 - t0)
        out["flood_requests"] = len(fl.spans)
        out["flood_errors"] = sorted(set(fl.errors))[:3]
        out["flood_refused"] = len(fl.errors)
    if results:
        ok = [r for r in results if r.ok]
        ttft = [r.ttft for r in ok]
        out.update(
            quiet_requests=len(results),
            quiet_failed=len(results) - len(ok),
            ttft_p50=pct(ttft, 50),
            ttft_p90=pct(ttft, 90),
            ttft_p99=pct(ttft, 99),
            itl_p50=pct([g for r in ok for g in r.gaps], 50),
        )
    return out


def run_phase(a: argparse.Namespace, tenants: Path, scheduling: str, **kw: Any) -> dict[str, Any]:
    server = start_kvgate(
        8411, a.threads, a.max_num_seqs,
        "--tenants", str(tenants), "--scheduling", scheduling, "--max-queue-len", "100000",
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
    )  # fmt: skip
    try:
        wait_healthy(server)
        warm = make_prompts(4, (16, 32), seed=99)

        async def warmup() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                await asyncio.gather(*(one_request(http, server.url, p, 8, QUIET) for p in warm))

        asyncio.run(warmup())
        return asyncio.run(phase(server.url, a, **kw))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of each mixed phase")
    ap.add_argument("--solo-duration", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--quiet-rate", type=float, default=1.0, help="quiet requests per second")
    ap.add_argument("--quiet-output-len", type=int, default=32)
    ap.add_argument("--flood-output-len", type=int, default=64)
    ap.add_argument("--flood-concurrency", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        tenants.write_text(TENANTS)
        print(
            f"{a.threads} threads, max_num_seqs {a.max_num_seqs}; quiet: {a.quiet_rate:g} req/s "
            f"streaming, {a.quiet_output_len} tokens; flooder: {a.flood_concurrency} in flight, "
            f"{a.flood_output_len} tokens; prompts {a.prompt_len[0]}-{a.prompt_len[1]} tokens",
            flush=True,
        )
        report: dict[str, dict[str, Any]] = {}
        plan = [
            ("capacity (flooder alone)", "fair", True, False, a.solo_duration),
            ("quiet alone", "fair", False, True, a.solo_duration),
            ("mixed, tenant-fair", "fair", True, True, a.duration),
            ("mixed, FIFO", "fifo", True, True, a.duration),
        ]
        for title, scheduling, with_flood, with_quiet, duration in plan:
            r = run_phase(
                a, tenants, scheduling,
                with_flood=with_flood, with_quiet=with_quiet, duration=duration,
            )  # fmt: skip
            report[title] = r
            line = f"{title:<26}"
            if "ttft_p99" in r:
                p50, p99 = r["ttft_p50"] * 1000, r["ttft_p99"] * 1000
                line += (
                    f" quiet TTFT p50 {p50:6.0f} ms p99 {p99:6.0f} ms "
                    f"({r['quiet_requests']} req, {r['quiet_failed']} failed)"
                )
            if "flood_tok_s" in r:
                line += f" | flooder {r['flood_tok_s']:6.1f} tok/s ({r['flood_refused']} refused)"
            print(line, flush=True)

    cap = report["capacity (flooder alone)"]["flood_tok_s"]
    solo = report["quiet alone"]["ttft_p99"]
    print("\nratios")
    for title in ("mixed, tenant-fair", "mixed, FIFO"):
        r = report[title]
        print(
            f"  {title:<20} quiet TTFT p99 {r['ttft_p99'] / solo:6.2f}x solo | "
            f"flooder {r['flood_tok_s'] / cap * 100:5.1f}% of capacity"
        )
    fair = report["mixed, tenant-fair"]
    print(
        f"targets (tenant-fair): quiet TTFT p99 <= 1.25x solo "
        f"({'met' if fair['ttft_p99'] <= 1.25 * solo else 'NOT met'}), flooder >= 90% of "
        f"capacity ({'met' if fair['flood_tok_s'] >= 0.9 * cap else 'NOT met'})"
    )
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
