"""Request streams: a caller that leaves before a request's end hears, once, what the engine
generated for it (``on_abandoned``), however the request then ends."""

from __future__ import annotations

import asyncio
from typing import cast

from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.engine.streams import Streams


class _Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def _out(rid: str, tokens: int, *, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid, new_token_ids=(1,), text="x", logprobs=(), finished=finished,
        finish_reason="abort" if finished else None, stop_reason=None, num_prompt_tokens=3,
        num_output_tokens=tokens, num_cached_tokens=0,
    )  # fmt: skip


async def _settle() -> None:
    for _ in range(5):  # call_soon_threadsafe callbacks run on the next loop iterations
        await asyncio.sleep(0)


def _left_after_one(
    streams: Streams, rid: str, aborted: list[str], told: list[RequestOutput | None]
) -> asyncio.Task[None]:
    async def caller() -> None:
        stream = streams.run(cast(Request, _Request(rid)), lambda r: None, aborted.append,
                             told.append)  # fmt: skip
        async for _ in stream:
            break  # leaves after the first output
        await stream.aclose()

    return asyncio.ensure_future(caller())


def test_a_caller_that_leaves_hears_the_engines_last_output_once() -> None:
    async def main() -> None:
        streams, aborted, told = Streams(), list[str](), list[RequestOutput | None]()
        task = _left_after_one(streams, "r1", aborted, told)
        await _settle()
        streams.deliver_all([_out("r1", 1), _out("r1", 2), _out("r1", 3)])  # 2, 3 unread
        await task
        assert aborted == ["r1"] and told == []  # waits for the engine's own end
        streams.deliver_all([_out("r1", 7, finished=True)])  # the abort's final output
        await _settle()
        assert [o.num_output_tokens if o else None for o in told] == [7]
        streams.gone(["r1"])
        await _settle()
        assert len(told) == 1 and streams.num_in_flight == 0

    asyncio.run(main())


def test_a_final_output_left_unread_is_told_at_once_and_a_dying_engine_tells_too() -> None:
    async def main() -> None:
        streams, aborted, told = Streams(), list[str](), list[RequestOutput | None]()
        task = _left_after_one(streams, "r1", aborted, told)
        await _settle()
        streams.deliver_all([_out("r1", 1), _out("r1", 4, finished=True)])
        await task
        assert aborted == [] and [o.num_output_tokens if o else None for o in told] == [4]
        other = _left_after_one(streams, "r2", aborted, told)
        await _settle()
        streams.deliver_all([_out("r2", 1), _out("r2", 2)])
        await other
        streams.fail_all(RuntimeError("engine died"))
        await _settle()
        late = [o.num_output_tokens if o else None for o in told[1:]]
        assert late == [2]  # the last it made before it died

    asyncio.run(main())


def test_a_caller_that_reads_the_end_is_not_told() -> None:
    async def main() -> None:
        streams, told = Streams(), list[RequestOutput | None]()

        async def caller() -> None:
            request = cast(Request, _Request("r1"))
            async for _ in streams.run(request, lambda r: None, lambda r: None, told.append):
                pass

        task = asyncio.ensure_future(caller())
        await _settle()
        streams.deliver_all([_out("r1", 1), _out("r1", 2, finished=True)])
        await task
        await _settle()
        assert told == []

    asyncio.run(main())
