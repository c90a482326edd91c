"""The engine in a process of its own (``core_proc.py`` behind ``core_client.py``): the same
tokens as the engine in this process, aborts that free the blocks, load errors raised as
they were, a killed engine process that fails its streams and is started again, and a peer
with a key of its own refused by the channel's gate (the rest of the channel and the engine
that does not outlive its front end: ``test_core_channel.py``)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core_client import EngineClient
from kvgate.engine.front import EngineFront
from kvgate.errors import EngineDead, KVCacheTooSmall, PromptTooLong
from kvgate.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config
from tests.engine.foreign_peer import ForeignPeer

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
PROMPTS = [[1, 5, 9, 2], [7, 7, 3], list(range(3, 40))]


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> Iterator[EngineClient]:
    engine = EngineClient(tiny_engine_config(tiny_llama_dir))
    yield engine
    engine.shutdown()


async def _tokens(front: EngineFront, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for delta in front.generate(prompt, params):
        out.extend(delta.new_token_ids)
    return out


async def _all(front: EngineFront) -> list[list[int]]:
    return await asyncio.gather(*(_tokens(front, p, GREEDY) for p in PROMPTS))


def _until(check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_same_tokens_as_the_engine_in_this_process(
    client: EngineClient, tiny_llama_dir: Path
) -> None:
    remote = asyncio.run(_all(client))
    local_engine = AsyncLLM.from_config(tiny_engine_config(tiny_llama_dir))
    try:
        local = asyncio.run(_all(local_engine))
    finally:
        local_engine.shutdown()
    assert remote == local and all(len(t) == 12 for t in remote)
    snap = client.snapshot()  # the snapshot crossed too
    assert snap.added >= 3 and snap.finished == snap.added and snap.kv_used == 0
    assert snap.build_info == client.engine.build_info


def test_bad_input_is_refused_on_the_front_ends_side(client: EngineClient) -> None:
    too_long = SamplingParams(max_tokens=10_000)
    with pytest.raises(PromptTooLong):
        asyncio.run(_tokens(client, [1, 2, 3], too_long))
    assert client.engine.blocks_for(100) > 0 and client.capacity is None


def test_leaving_a_stream_early_aborts_it_and_frees_its_blocks(client: EngineClient) -> None:
    async def leave() -> int:
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        stream = client.generate([4, 4, 4], params)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        return got

    assert asyncio.run(leave()) == 3
    _until(lambda: client.snapshot().running == 0 and client.snapshot().kv_used == 0)
    assert client.num_in_flight == 0


def test_a_load_error_is_raised_as_the_engine_raised_it(tiny_llama_dir: Path) -> None:
    with pytest.raises(KVCacheTooSmall, match="kv_cache_memory"):
        EngineClient(tiny_engine_config(tiny_llama_dir, kv_cache_memory="64KiB"))


@pytest.mark.slow
def test_a_killed_engine_fails_its_streams_and_a_fresh_one_takes_over(
    tiny_llama_dir: Path,
) -> None:
    front = EngineClient(tiny_engine_config(tiny_llama_dir))
    try:
        first_pid = front.pid
        assert first_pid is not None

        async def killed_mid_stream() -> tuple[int, BaseException | None]:
            params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
            got = 0
            try:
                async for _ in front.generate([3, 1, 4], params):
                    got += 1
                    if got == 2:
                        os.kill(first_pid, signal.SIGKILL)
            except EngineDead as exc:
                return got, exc
            return got, None

        got, error = asyncio.run(killed_mid_stream())
        assert error is not None and "exited with code -9" in str(error), (got, error)
        assert got < 400 and not front.is_running and front.is_restarting
        with pytest.raises(EngineDead):  # refused while the fresh engine loads
            asyncio.run(_tokens(front, [1, 2], GREEDY))
        _until(lambda: front.is_running, timeout=60)
        assert front.pid != first_pid and not front.is_restarting
        assert len(asyncio.run(_tokens(front, [1, 2], GREEDY))) == 12
    finally:
        front.shutdown()
    assert front.pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(front.pid, 0)  # shut down: the engine process is gone


@pytest.mark.parametrize("role", ["results", "commands"])
def test_a_peer_that_knows_the_server_key_is_still_refused_by_the_gate(
    client: EngineClient, tmp_path: Path, role: str
) -> None:
    # The strongest outsider: one that somehow read the front end's public key, with a key
    # pair of its own; the ZAP handler admits the engine's key only.
    marker = tmp_path / "unpickled"
    server_key = client._channel.keys.server_public
    with ForeignPeer(client.socket_dir, role, server_key, marker) as peer:
        assert peer.outcome() == "HANDSHAKE_FAILED_AUTH"
        # Every request's Add reached the engine (a thief would hold some: they would hang).
        tokens = asyncio.run(asyncio.wait_for(_all(client), 120))
        assert [len(t) for t in tokens] == [12] * len(PROMPTS)
        assert peer.received() == 0
    assert not marker.exists()


def test_errors_and_snapshots_cross_the_process_boundary(client: EngineClient) -> None:
    snap = pickle.loads(pickle.dumps(client.snapshot()))
    assert snap == client.snapshot()
    with pytest.raises(TypeError):  # still read-only after the trip
        snap.tenants["x"] = None  # type: ignore[index]
    error = pickle.loads(pickle.dumps(PromptTooLong(9, 8, 7)))
    assert isinstance(error, PromptTooLong) and error.max_model_len == 7
    assert error.param == "prompt" and "7 tokens" in str(error)
