"""Replicas on Ray Serve: throughput of 1 vs 2 replicas, prefix hit rate of cache-aware
routing against load-only routing, and the time from an injected canary fault to rollback.

1. Serving (``serving.py``'s load: streaming /v1/completions, random prompts, fixed output,
   ``concurrency`` at a time): plain ``kvgate serve`` (no Ray), then the cluster with one
   replica (all threads), then two replicas (the threads split between them).
2. Shared document prefixes: ``--docs`` documents of ~``--doc-tokens`` tokens, each asked
   ``--questions`` questions, in a shuffled order, 4 at a time, to two replicas whose KV
   pools each hold about half the documents: routed by prefix affinity, then by load alone
   (``least_loaded``: the least busy replica, as Ray's default router would pick). Hit
   rate = prefix-cache hits / queries over both replicas (their /metrics, before/after).
3. Rollback: a canary injecting ``errors=0.5`` (the controller's ``fault``) takes 50% of
   steady traffic; reported: seconds from its first request to the rollback decision, and
   to its last response.

    python bench/cluster.py                       # all three
    python bench/cluster.py --only prefix --docs 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import Server, fmt_row, make_prompts, run_load, summarize, wait_healthy

from kvgate.cluster.app import ClusterSpec, start, stop
from kvgate.model import cpu_isa

PORT = 8123


def base_argv(threads: int, kv: str, data: str) -> tuple[str, ...]:
    return (
        "--threads",
        str(threads),
        "--kv-cache-memory",
        kv,
        "--max-model-len",
        "4096",
        "--data-dir",
        data,
        "--usage-db",
        f"{data}/usage.sqlite3",
        "--access-log",
        "",
    )


def serving_run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = make_prompts(args.num_requests, (50, 200), seed=1)
    asyncio.run(run_load(url, prompts[:2], 8, rate=None, concurrency=2, seed=0))  # warm-up
    results, wall = asyncio.run(
        run_load(url, prompts, args.output_len, rate=None, concurrency=args.concurrency, seed=0)
    )
    return summarize(results, wall)


def bench_serving(args: argparse.Namespace, data: str) -> None:
    threads = os.cpu_count() or 2
    print(
        f"\n== serving: {args.num_requests} requests, {args.output_len} tokens out, "
        f"concurrency {args.concurrency} ==",
        flush=True,
    )
    rows: dict[str, dict[str, Any]] = {}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvgate.entrypoints.cli",
            "serve",
            "--port",
            str(PORT + 1),
            *base_argv(threads, "512MiB", data),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{PORT + 1}"
        wait_healthy(Server("kvgate", url, proc))
        rows["kvgate serve"] = serving_run(url, args)
        print(fmt_row("plain", rows["kvgate serve"]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    for replicas in (1, 2):
        argv = base_argv(max(1, threads // replicas), f"{512 // replicas}MiB", data)
        start(ClusterSpec(argv, replicas=replicas), "127.0.0.1", PORT)
        try:
            url = f"http://127.0.0.1:{PORT}"
            name = f"{replicas} replica" + ("s" if replicas > 1 else "")
            rows[name] = serving_run(url, args)
            print(fmt_row(name.replace(" replica", "r"), rows[name]), flush=True)
        finally:
            stop()
    one, two, plain = rows["1 replica"], rows["2 replicas"], rows["kvgate serve"]
    print(
        "  ratios: 2 replicas / 1 replica: output tok/s "
        f"{two['output_tok_s'] / one['output_tok_s']:.2f}x, "
        f"TTFT p99 {two['ttft_p99'] / one['ttft_p99']:.2f}x; "
        "1 replica on Ray / plain kvgate serve: "
        f"tok/s {one['output_tok_s'] / plain['output_tok_s']:.2f}x, "
        f"TTFT p99 {one['ttft_p99'] / plain['ttft_p99']:.2f}x",
        flush=True,
    )


def _cache_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total{"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def bench_prefix(args: argparse.Namespace, data: str) -> None:
    docs = make_prompts(args.docs, (args.doc_tokens, args.doc_tokens), seed=7)
    rng = random.Random(3)
    work = [(d, q) for d in range(args.docs) for q in range(args.questions)]
    rng.shuffle(work)
    print(
        f"\n== shared prefixes: {args.docs} documents x ~{args.doc_tokens} tokens, "
        f"{args.questions} questions each, 2 replicas of {args.kv} KV ==",
        flush=True,
    )
    rates: dict[str, float] = {}
    for routing in ("affinity", "least_loaded"):
        start(
            ClusterSpec(base_argv(1, args.kv, data), replicas=2, routing=routing), "127.0.0.1", PORT
        )
        url = f"http://127.0.0.1:{PORT}"
        try:
            before = _cache_counters(url)

            async def go(url: str = url) -> float:
                gate = asyncio.Semaphore(4)
                async with httpx.AsyncClient(timeout=600) as http:

                    async def one(d: int, q: int) -> None:
                        body = {
                            "prompt": f"{docs[d]}\nQuestion {q}: what does it say?",
                            "max_tokens": 4,
                            "temperature": 0,
                        }
                        async with gate:
                            r = await http.post(f"{url}/v1/completions", json=body)
                            r.raise_for_status()

                    t0 = time.perf_counter()
                    await asyncio.gather(*(one(d, q) for d, q in work))
                    return time.perf_counter() - t0

            wall = asyncio.run(go())
            time.sleep(5)  # the replicas push their metrics every 2 s
            after = _cache_counters(url)
            hits, queries = after[0] - before[0], after[1] - before[1]
            rates[routing] = hits / queries if queries else 0.0
            print(
                f"  {routing:<12} hit rate {rates[routing]:.3f} ({hits:.0f} of {queries:.0f} "
                f"prompt tokens), {len(work)} requests in {wall:.1f} s",
                flush=True,
            )
        finally:
            stop()
    print(
        f"  ratio: affinity / least_loaded hit rate "
        f"{rates['affinity'] / max(rates['least_loaded'], 1e-9):.2f}x",
        flush=True,
    )


def bench_rollback(args: argparse.Namespace, data: str) -> None:
    import ray

    from kvgate.cluster.controller import CONTROLLER
    from kvgate.cluster.state import NAMESPACE

    print("\n== rollback: canary with fault errors=0.5, steps 50,100, interval 30 s ==", flush=True)
    golden = Path(data) / "golden.jsonl"
    golden.write_text(
        '{"prompt": "What is the capital of France? Answer in one word.", "expect": "Paris"}\n'
    )
    start(ClusterSpec(base_argv(1, "128MiB", data), replicas=1), "127.0.0.1", PORT)
    url = f"http://127.0.0.1:{PORT}"
    stop_traffic = threading.Event()
    seen: list[tuple[float, str, int]] = []

    def client(i: int) -> None:
        while not stop_traffic.is_set():
            body = {"prompt": "Say hi.", "max_tokens": 2}
            r = httpx.post(
                f"{url}/v1/completions",
                json=body,
                timeout=60,
                headers={"Authorization": f"Bearer sk-{i}"},
            )
            seen.append((time.time(), r.headers.get("x-kvgate-model-version", ""), r.status_code))

    try:
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        ray.get(
            controller.start.remote(
                ["--model", "smollm2", "--max-model-len", "2048"],
                [50, 100],
                30.0,
                [
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": "What is the capital of France? Answer in one word.",
                            }
                        ],
                        "expect": "Paris",
                    }
                ],
                fault="errors=0.5",  # the canary's replicas answer half their requests 500
            )
        )
        while ray.get(controller.status.remote())["state"] in ("loading", "progressing"):
            time.sleep(0.2)
        time.sleep(3)
        stop_traffic.set()
        for t in threads:
            t.join(60)
        status = ray.get(controller.status.remote())
    finally:
        stop()
    decision = status["history"][-1]
    stable = status["stable"]["version"]
    canary = [t for t, v, _ in seen if v != stable]
    decided = decision["ts"]
    print(
        f"  decision: {decision['decision']} ({decision.get('reason')}), "
        f"{decision.get('seconds_into_step')} s after the canary took traffic; canary "
        f"{decision.get('canary')}, stable {decision.get('stable')}",
        flush=True,
    )
    if canary:
        print(
            f"  canary responses: {len(canary)}, the last {max(canary) - decided:+.2f} s from the "
            f"decision (requests already sent to it finishing); full rollback "
            f"{max(canary) - min(canary):.2f} s after its first response",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=["serving", "prefix", "rollback"], default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=700)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--kv", default="96MiB", help="each replica's KV pool in the prefix run")
    args = p.parse_args()
    os.environ.setdefault("KVGATE_RAY_LOGS", "0")
    print(f"CPU: {cpu_isa.describe_cpu()}", flush=True)
    with tempfile.TemporaryDirectory() as data:
        if args.only in (None, "serving"):
            bench_serving(args, data)
        if args.only in (None, "prefix"):
            bench_prefix(args, data)
        if args.only in (None, "rollback"):
            bench_rollback(args, data)


if __name__ == "__main__":
    main()
