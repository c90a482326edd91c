"""What storing a response costs: the latency of ``POST /v1/responses`` with ``store`` on
(the default: a row written as it starts and again as it ends) against ``store: false``,
alternated request by request on one ``kvgate serve``, so drift on a shared machine falls
on both alike. Then a ``previous_response_id`` chain: what its prompt reads from the prefix
cache, and its latency against sending the same conversation whole.

    python bench/responses_store.py                       # SmolLM2 (the default model)
    python bench/responses_store.py --requests 200 --max-output-tokens 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import SERVED_NAME, pct, start_kvgate, wait_healthy


def timed(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = client.post("/v1/responses", json={"model": SERVED_NAME, **body})
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed, r.json()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=100, help="per setting, alternated")
    p.add_argument("--max-output-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8431)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = start_kvgate("kvgate", a.model, a.port, a.threads, 8, "--data-dir", data)
        try:
            wait_healthy(server)
            client = httpx.Client(base_url=server.url, timeout=120)
            base = {"max_output_tokens": a.max_output_tokens, "temperature": 0}
            on: list[float] = []
            off: list[float] = []
            for i in range(a.requests + 5):  # the first 5 pairs warm up
                question = f"Question {i}: name a colour."
                for store, into in ((True, on), (False, off)) if i % 2 else (
                        (False, off), (True, on)):  # fmt: skip
                    elapsed, _ = timed(client, {**base, "input": question, "store": store})
                    if i >= 5:
                        into.append(elapsed)
            for name, values in (("store on", on), ("store off", off)):
                p50, p90 = pct(values, 50) * 1000, pct(values, 90) * 1000
                print(f"{name:<10} p50 {p50:7.2f} ms  p90 {p90:7.2f} ms  ({len(values)} requests)")
            extra = statistics.median(x - y for x, y in zip(on, off, strict=True)) * 1000
            print(f"store on - off, median of the pairs: {extra:+.2f} ms")
            words = " ".join(f"word{i}" for i in range(300))
            first_s, first = timed(client, {**base, "input": words})
            chained_s, chained = timed(client, {**base, "input": "And then?",
                                                "previous_response_id": first["id"]})  # fmt: skip
            text = first["output"][0]["content"][0]["text"]
            whole = [{"role": "user", "content": words}, {"role": "assistant", "content": text},
                     {"role": "user", "content": "And then?"}]  # fmt: skip
            resent_s, resent = timed(client, {**base, "input": whole, "store": False})
            usage = chained["usage"]
            resent_cached = resent["usage"]["input_tokens_details"]["cached_tokens"]
            print(f"chain: first {first_s * 1000:.1f} ms ({first['usage']['input_tokens']} "
                  f"input tokens); chained {chained_s * 1000:.1f} ms, {usage['input_tokens']} "
                  f"input tokens of which {usage['input_tokens_details']['cached_tokens']} "
                  f"cached; the same conversation sent whole {resent_s * 1000:.1f} ms "
                  f"({resent_cached} cached)")  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
