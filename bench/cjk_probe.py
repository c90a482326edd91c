"""The audit's CJK probe (issue 43): eight requests of 1.32 M Chinese characters (3.96 MB of
JSON each) sent at once by one tenant, while another tenant streams an answer and /health is
polled every 50 ms (from a client process of their own). Reported: /health latency (p50,
p99, max), the other tenant's inter-token gap (p50, p99, max), and what the probe's requests
got back.

Text of about a token per character passed the old size gate (the context times the longest
token: 8192 x 162 characters for SmolLM2) and was tokenized whole, holding the GIL: /health
p50 4.2 s, a 10.3 s gap in the other stream. Run it against a checkout to compare:

    python bench/cjk_probe.py                 # this checkout
    python bench/cjk_probe.py --rounds 3      # three waves of the probe during the stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.queues import Queue
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import pct, start_kvgate, wait_healthy

TENANTS = """
[tenants.prober]
keys = ["sk-prober"]

[tenants.quiet]
keys = ["sk-quiet"]
"""
LAW = "第一千零七十九条夫妻一方要求离婚的可以由有关组织进行调解或者直接向人民法院提起离婚诉讼"


async def health_poll(url: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            t = time.perf_counter()
            await client.get(f"{url}/health")
            out.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)


async def quiet_stream(url: str, tokens: int, gaps: list[float]) -> None:
    body = {"model": "smollm2", "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": tokens, "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": "Bearer sk-quiet"}
    async with (
        httpx.AsyncClient(timeout=600) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp,
    ):
        last = None
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


async def probe(url: str, payload: bytes, statuses: Counter[str]) -> None:
    headers = {"Authorization": "Bearer sk-prober", "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=600) as client:
        resp = await client.post(f"{url}/v1/chat/completions", content=payload, headers=headers)
    code = resp.json().get("error", {}).get("code", "ok") if resp.status_code != 200 else "ok"
    statuses[f"{resp.status_code} {code}"] += 1


async def watch(url: str, tokens: int) -> tuple[list[float], list[float]]:
    """The other tenant's stream and the /health poll, until the stream ends."""
    health: list[float] = []
    gaps: list[float] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(health_poll(url, stop, health))
    await quiet_stream(url, tokens, gaps)
    stop.set()
    await poller
    return health, gaps


def watcher(url: str, tokens: int, out: Queue[tuple[list[float], list[float]]]) -> None:
    out.put(asyncio.run(watch(url, tokens)))


async def run(url: str, args: argparse.Namespace) -> None:
    # The watcher is a process of its own, as another tenant's client is: in this one, the
    # probe's own sends delayed its reading of the stream by hundreds of ms.
    results: Queue[tuple[list[float], list[float]]] = multiprocessing.Queue()
    proc = multiprocessing.Process(target=watcher, args=(url, args.tokens, results))
    text = (LAW * (args.chars // len(LAW) + 1))[: args.chars]
    payload = json.dumps(
        {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        ensure_ascii=False,
    ).encode()
    statuses: Counter[str] = Counter()
    proc.start()
    await asyncio.sleep(2)  # the stream under way
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        await asyncio.gather(*(probe(url, payload, statuses) for _ in range(args.requests)))
    probe_s = time.perf_counter() - t0
    health, gaps = results.get()
    proc.join()
    ms = [h * 1000 for h in health]
    gms = [g * 1000 for g in gaps]
    print(f"probe: {args.rounds} x {args.requests} requests of {args.chars} characters "
          f"({len(payload)} bytes), {probe_s:.1f} s; answers {dict(statuses)}")  # fmt: skip
    print(f"/health ms: p50 {pct(ms, 50):.1f} p99 {pct(ms, 99):.1f} max {max(ms):.1f} "
          f"({len(ms)} polls)")  # fmt: skip
    print(f"other tenant's inter-token ms: p50 {pct(gms, 50):.1f} p99 {pct(gms, 99):.1f} "
          f"max {max(gms):.1f} ({len(gms) + 1} tokens)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--chars", type=int, default=1_320_000)
    ap.add_argument("--tokens", type=int, default=200, help="the other tenant's answer")
    args = ap.parse_args()
    tenants = Path(tempfile.mkdtemp(prefix="kvgate-probe-")) / "tenants.toml"
    tenants.write_text(TENANTS)
    server = start_kvgate("kvgate", args.port, 2, 8, "--tenants", str(tenants))
    try:
        wait_healthy(server)
        asyncio.run(run(server.url, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
