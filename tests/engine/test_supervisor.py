"""The engine's supervisor: an unexpected error ends the requests in flight with an error and
the loop carries on; a failing detokenizer fails one request, not the loop; errors that keep
coming stop the loop and call ``on_dead``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.config import EngineConfig
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.llm_engine import EngineStep
from kvgate.errors import EngineDead, RequestFailed
from kvgate.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)


@pytest.fixture
def llm(tiny_llama_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM.from_config(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                     max_model_len=256)
    )  # fmt: skip
    yield engine
    engine.shutdown()


async def _run(llm: AsyncLLM, prompt: list[int], params: SamplingParams = GREEDY) -> Any:
    try:
        return [o async for o in llm.generate(prompt, params)]
    except Exception as exc:
        return exc


def _fail_steps(llm: AsyncLLM, times: int) -> list[int]:
    """Make the next ``times`` engine steps raise; returns the count of raised errors."""
    raised: list[int] = []
    begin = llm.engine.begin_step

    def failing(*, pause: bool = False) -> EngineStep:
        if len(raised) < times:
            raised.append(1)
            raise RuntimeError("simulated scheduler bug")
        return begin(pause=pause)

    llm.engine.begin_step = failing  # type: ignore[method-assign]
    return raised


def test_an_unexpected_step_error_fails_the_requests_in_flight_and_the_loop_goes_on(
    llm: AsyncLLM,
) -> None:
    _fail_steps(llm, 1)

    async def main() -> list[Any]:
        return await asyncio.gather(*(_run(llm, [300 + i] * 5) for i in range(3)))

    results = asyncio.run(main())
    assert all(isinstance(r, RequestFailed) for r in results), results
    assert "simulated scheduler bug" in str(results[0])
    assert llm.is_running and llm.engine.num_recoveries == 1
    assert llm.engine.kv_cache.pool.num_used_blocks == 0
    # Served as before afterwards.
    outs = asyncio.run(_run(llm, [400, 401]))
    assert isinstance(outs, list) and outs[-1].finish_reason == "length"


def test_errors_that_keep_coming_stop_the_loop_and_call_on_dead(llm: AsyncLLM) -> None:
    dead: list[BaseException] = []
    llm.on_dead = dead.append
    _fail_steps(llm, AsyncLLM.MAX_RECOVERIES + 1)
    for i in range(AsyncLLM.MAX_RECOVERIES + 1):
        result = asyncio.run(_run(llm, [500 + i]))
        assert isinstance(result, RequestFailed | EngineDead)
    deadline = time.monotonic() + 5
    # The loop marks itself dead, fails its streams, then calls on_dead: wait for both.
    while (llm.is_running or not dead) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.is_running and len(dead) == 1
    assert isinstance(asyncio.run(_run(llm, [1, 2])), EngineDead)


def test_a_failing_detokenizer_fails_its_request_only(llm: AsyncLLM) -> None:
    engine = llm.engine
    original_add = engine.add

    def add(request: Any) -> None:
        original_add(request)
        if request.prompt_token_ids[0] == 666:
            detok = engine._outputs[request.request_id].detokenizer

            def broken(finished: bool) -> str:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")

            detok.take_delta = broken  # type: ignore[method-assign]

    engine.add = add  # type: ignore[method-assign]

    async def main() -> list[Any]:
        return await asyncio.gather(_run(llm, [666, 1, 2]), _run(llm, [300, 1, 2]))

    bad, good = asyncio.run(main())
    assert isinstance(good, list) and good[-1].finish_reason == "length"
    assert isinstance(bad, list) and bad[-1].finish_reason == "error"
    assert "detokenizer failed" in (bad[-1].error or "")
    assert llm.is_running and engine.num_recoveries == 0
