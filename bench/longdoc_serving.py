"""Chat latency while the whole shared corpus is ingested, against the same load alone.

    python bench/longdoc_serving.py [--clients 2] [--seconds 60]

Starts ``kvgate serve`` (SmolLM2, its own data directory), runs a steady chat load
(``--clients`` streams one after another each, short prompts, 16 tokens) for ``--seconds``
alone, then uploads the corpus into one vector store and runs the same load while it is
indexed. Prints TTFT p50/p99 of both windows, the ingestion's characters per second under
load and alone (as the server logged them), and the ratios last.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import pct, start_kvgate, wait_healthy


async def chat_load(url: str, clients: int, seconds: float) -> list[float]:
    ttfts: list[float] = []
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            n = 0
            while time.monotonic() < deadline:
                body = {
                    "model": "smollm2", "max_tokens": 16, "stream": True,
                    "messages": [{"role": "user", "content": f"Say something nice ({i}.{n})."}],
                }  # fmt: skip
                start = time.perf_counter()
                first = True
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():  # read to the end, as clients do
                        if first and '"content":"' in line and '"content":""' not in line:
                            ttfts.append(time.perf_counter() - start)
                            first = False
                n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return sorted(ttfts)


def ingest(url: str, corpus: Path, name: str = "corpus") -> tuple[str, int, list[str]]:
    """Upload every law and start one store over them: (store id, characters, file ids)."""
    ids, chars = [], 0
    with httpx.Client(timeout=120) as http:
        for path in sorted(corpus.glob("*.md")):
            chars += len(path.read_text(encoding="utf-8"))
            r = http.post(
                f"{url}/v1/files",
                files={"file": (path.name, path.read_bytes())},
                data={"purpose": "assistants"},
            )
            r.raise_for_status()
            ids.append(r.json()["id"])
        store = http.post(f"{url}/v1/vector_stores", json={"name": name, "file_ids": ids})
        store.raise_for_status()
        return store.json()["id"], chars, ids


def wait_store(url: str, store_id: str) -> float:
    start = time.monotonic()
    while httpx.get(f"{url}/v1/vector_stores/{store_id}").json()["status"] != "completed":
        time.sleep(0.5)
    return time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/longdoc"))
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--port", type=int, default=8123)
    a = p.parse_args()
    corpus = Path(a.corpus) / "corpus"
    data = Path(tempfile.mkdtemp(prefix="kvgate-longdoc-"))
    server = start_kvgate("kvgate", "smollm2", a.port, 2, 32, "--data-dir", str(data))
    try:
        wait_healthy(server)
        url = server.url
        asyncio.run(chat_load(url, a.clients, 5))  # warm-up
        alone = asyncio.run(chat_load(url, a.clients, a.seconds))
        t0 = time.monotonic()
        store_id, chars, ids = ingest(url, corpus)
        during = asyncio.run(chat_load(url, a.clients, a.seconds))
        busy = time.monotonic() - t0
        total = busy + wait_store(url, store_id)
        counts = httpx.get(f"{url}/v1/vector_stores/{store_id}").json()["file_counts"]
        # The same files into a second store with nothing else running: ingestion alone.
        t1 = time.monotonic()
        again = httpx.post(f"{url}/v1/vector_stores", json={"file_ids": ids}, timeout=60)
        idle_total = time.monotonic() - t1 + wait_store(url, again.json()["id"])
    finally:
        server.proc.terminate()
        server.proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    for label, ttfts in (("chat alone:           ", alone), ("chat during ingestion:", during)):
        tail = " / ".join(f"{pct(ttfts, q) * 1e3:.0f}" for q in (90, 95, 99))
        print(f"{label} {len(ttfts)} requests, TTFT p50 {pct(ttfts, 50) * 1e3:.0f} ms, "
              f"p90 / p95 / p99 {tail} ms, max {ttfts[-1] * 1e3:.0f} ms")  # fmt: skip
    print(f"ingestion: {chars} characters, {counts['completed']}/{counts['total']} files in "
          f"{total:.0f} s = {chars / total:.0f} characters/s (chat ran for the first "
          f"{busy:.0f} s of it)")  # fmt: skip
    print(f"ingestion alone: {idle_total:.0f} s = {chars / idle_total:.0f} characters/s "
          "(the files' text is kept: chunking, embedding and indexing)")  # fmt: skip
    print(f"ratio: TTFT p99 during / alone = {pct(during, 99) / pct(alone, 99):.2f}x "
          f"(target <= 1.5x); p50 {pct(during, 50) / pct(alone, 50):.2f}x; chat requests "
          f"served {len(during) / len(alone):.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
