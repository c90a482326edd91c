"""Streams under load: many at once, some dropped midway; nothing lost, nothing leaked."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from tests.server.conftest import (
    API_KEY,
    MODEL,
    LiveServer,
    aborted_requests,
    metric,
    scrape_metrics,
    wait_idle,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_dropped_streams_free_their_blocks_at_once(live_server: LiveServer) -> None:
    """20 streams, 10 dropped after a few chunks: the 10 are aborted (not run to length) and
    /metrics shows running requests and KV usage back at zero within a second."""
    wait_idle(live_server)
    aborted_before = aborted_requests(live_server)
    url = f"{live_server.api_url}/completions"

    async def one(i: int, drop: bool) -> int:
        body = {
            "prompt": f"stream number {i} " * (1 + i % 5),
            "max_tokens": 450 if drop else 30,
            "ignore_eos": True,
            "stream": True,
        }
        events = 0
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream("POST", url, json=body, headers=AUTH) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if drop and events == 4:
                        break  # leaving the block closes the connection mid-stream
        return events

    async def run() -> tuple[list[int], float]:
        counts = await asyncio.gather(*(one(i, drop=i % 2 == 0) for i in range(20)))
        return list(counts), time.monotonic()

    counts, all_done = asyncio.run(run())
    assert [c for i, c in enumerate(counts) if i % 2 == 0] == [4] * 10
    # role-less completions: 30 content events at most, a finish event and [DONE]
    assert all(c >= 3 for i, c in enumerate(counts) if i % 2 == 1)
    while True:
        values = scrape_metrics(live_server)
        if (
            metric(values, "vllm:num_requests_running") == 0
            and metric(values, "vllm:kv_cache_usage_perc") == 0
        ):
            break
        # Freed as the aborts land, not by a clock: the bound only stops a hang.
        assert time.monotonic() - all_done < 60, values
        time.sleep(0.02)
    assert aborted_requests(live_server) == aborted_before + 10
    assert metric(values, "vllm:num_requests_waiting") == 0
    assert metric(values, "kvgate:num_requests_running_spare") == 0


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=512)


def test_64_concurrent_streams_lose_nothing(live_server: LiveServer, reference: LLM) -> None:
    """Every stream's chunks, in order, add up to exactly the offline engine's greedy text."""
    n_clients, max_tokens = 64, 24
    prompts = [[1000 + 37 * i + j for j in range(4 + i % 29)] for i in range(n_clients)]
    expected = reference.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    client = openai.AsyncOpenAI(
        base_url=live_server.api_url,
        api_key=API_KEY,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=n_clients), timeout=60
        ),
    )

    async def one(prompt: list[int]) -> tuple[list[str], list[str | None], set[str], int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts, reasons, ids, usage = [], [], set(), -1
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                texts.append(choice.text)
                reasons.append(choice.finish_reason)
        return texts, reasons, ids, usage

    async def run() -> list[tuple[list[str], list[str | None], set[str], int]]:
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len({next(iter(ids)) for _, _, ids, _ in results}) == n_clients  # one id per stream
    for (texts, reasons, ids, usage), want in zip(results, expected, strict=True):
        assert len(ids) == 1
        assert "".join(texts) == want.text
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        assert usage == max_tokens
    wait_idle(live_server)


def test_stream_events_are_well_formed_sse(live_server: LiveServer) -> None:
    """Raw wire format: ``data: {json}`` events separated by blank lines, then ``[DONE]``."""
    body = {
        "messages": [{"role": "user", "content": "写一首关于缓存的诗 🎉"}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{live_server.api_url}/chat/completions", json=body, headers=AUTH
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = raw.decode("utf-8").split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    for p in payloads[1:-1]:
        assert set(p["choices"][0]["delta"]) == {"content"}
        assert "\ufffd" not in p["choices"][0]["delta"]["content"]
