"""The async front: streaming deltas, abort on early exit, isolation of bad requests."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.config import EngineConfig
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.outputs import RequestOutput
from kvgate.errors import DuplicateRequestId, EmptyPrompt, EngineDead
from kvgate.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM.from_config(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            kv_cache_memory="32MiB",
            max_model_len=512,
            max_num_batched_tokens=128,
        )
    )
    yield llm
    llm.shutdown()


def _wait_until_idle(llm: AsyncLLM, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if llm.engine.kv_cache.pool.num_used_blocks == 0 and not llm.engine.scheduler.requests:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {llm.engine.scheduler.requests}")


async def _collect(
    llm: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str | None = None
) -> list[RequestOutput]:
    return [o async for o in llm.generate(prompt, params, rid)]


def test_stream_deltas_add_up_to_the_whole(async_llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    outs = asyncio.run(_collect(async_llm, [400, 401, 402], params))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == 10
    assert "".join(o.text for o in outs) == async_llm.engine.tokenizer.decode(ids)


def test_a_step_wakes_the_event_loop_once_for_all_its_streams(async_llm: AsyncLLM) -> None:
    """Eight streams decoding together: each step's deltas reach the loop in one hand-over
    (each costs a self-pipe write and a GIL hand-over), and every stream still gets all of
    its deltas, in order."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    prompts = [[500 + 7 * i, 501, 502 + i] for i in range(8)]

    async def run() -> tuple[list[list[RequestOutput]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            outs = await asyncio.gather(*(_collect(async_llm, p, params) for p in prompts))
        finally:
            del loop.call_soon_threadsafe  # type: ignore[method-assign]
        return list(outs), wakeups

    steps = async_llm.engine.num_steps
    outs, wakeups = asyncio.run(run())
    steps = async_llm.engine.num_steps - steps
    for stream in outs:
        assert sum(len(o.new_token_ids) for o in stream) == 12 and stream[-1].finished
    num_deltas = sum(len(stream) for stream in outs)
    assert wakeups <= steps < num_deltas


def test_leaving_the_stream_aborts_the_request(async_llm: AsyncLLM) -> None:
    async def consume_three() -> None:
        gen = async_llm.generate(
            [5] * 50, SamplingParams(max_tokens=400, ignore_eos=True), "leaver"
        )
        n = 0
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()

    asyncio.run(consume_three())
    _wait_until_idle(async_llm, timeout=2.0)


def test_cancel_storm_over_async_streams(async_llm: AsyncLLM) -> None:
    """100 concurrent streams, 30 cancelled at random points: every block comes back."""
    rng = random.Random(5)

    async def one(i: int, cancel_after: int | None) -> str | None:
        params = SamplingParams(
            max_tokens=rng.randrange(4, 30), ignore_eos=True, temperature=0.7, seed=i
        )
        n = 0
        last = None
        async for out in async_llm.generate(
            [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 80))], params
        ):
            n += 1
            last = out.finish_reason
            if cancel_after is not None and n >= cancel_after:
                return "cancelled"
        return last

    async def storm() -> list[str | None]:
        doomed = set(rng.sample(range(100), 30))
        tasks = [one(i, rng.randrange(1, 4) if i in doomed else None) for i in range(100)]
        return await asyncio.gather(*tasks)

    results = asyncio.run(storm())
    assert results.count("cancelled") == 30
    assert results.count("length") == 70
    _wait_until_idle(async_llm)


def test_bad_request_raises_and_others_still_run(async_llm: AsyncLLM) -> None:
    async def scenario() -> list[RequestOutput]:
        with pytest.raises(EmptyPrompt):
            await _collect(async_llm, [], SamplingParams())
        good = asyncio.create_task(
            _collect(async_llm, [9, 8, 7], SamplingParams(max_tokens=5, ignore_eos=True), "good")
        )
        await asyncio.sleep(0)
        with pytest.raises(DuplicateRequestId):
            await _collect(async_llm, [1, 2], SamplingParams(), "good")
        return await good

    outs = asyncio.run(scenario())
    assert outs[-1].finish_reason == "length"
    _wait_until_idle(async_llm)


def test_an_abandoned_id_is_reusable_once_its_abort_is_done(async_llm: AsyncLLM) -> None:
    async def scenario() -> list[RequestOutput]:
        gen = async_llm.generate([3] * 20, SamplingParams(max_tokens=300, ignore_eos=True), "same")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(200):  # the id frees as soon as the engine has processed the abort
            try:
                return await _collect(
                    async_llm, [4] * 5, SamplingParams(max_tokens=3, ignore_eos=True), "same"
                )
            except DuplicateRequestId:
                await asyncio.sleep(0.01)
        raise AssertionError("id never freed")

    outs = asyncio.run(scenario())
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 3
    _wait_until_idle(async_llm)


def test_shutdown_ends_open_streams_and_refuses_new_ones(tiny_llama_dir: Path) -> None:
    llm = AsyncLLM.from_config(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=512
        )
    )

    async def scenario() -> None:
        gen = llm.generate([5] * 10, SamplingParams(max_tokens=400, ignore_eos=True))
        first = await gen.__anext__()
        assert not first.finished
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDead):
            async for _ in gen:
                pass
        with pytest.raises(EngineDead):
            await _collect(llm, [1, 2], SamplingParams())

    asyncio.run(scenario())
