"""The disk KV tier in the engine: a prefix the pool evicted comes back from the tier, not
recomputed (and gives the same tokens); the same after a restart; never across tenants,
models or KV dtypes; a corrupt file is skipped; cancels during a load give every block back."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.engine.llm_engine import LLMEngine
from kvgate.sampling_params import SamplingParams
from kvgate.server.metrics import EngineCollector
from tests.conftest import tiny_engine_config

PROMPT = list(range(300, 300 + 200))  # 200 tokens: 12 full blocks of 16 cached
OTHER = list(range(1000, 1000 + 200))


def _engine(model: Path, tier: Path, **overrides: Any) -> LLMEngine:
    # A block: 2 layers x K, V x 2 KV heads x 32 dims x 16 tokens x 4 bytes = 8 KiB. 20
    # blocks: one 200-token request (13 blocks) fits, two of 240 tokens do not.
    settings: dict[str, Any] = {
        "kv_cache_memory": 20 * 8192,
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "kv_tier": "disk",
        "kv_tier_dir": str(tier),
        "kv_tier_size": "64MiB",
        "dtype": "float32",
    }
    settings.update(overrides)
    engine = LLMEngine(tiny_engine_config(model, **settings))
    # Whether a load beats a recompute is measured (``offload.LoadCosts``, tested on its
    # own); here the tier is always tried, so no test depends on the machine's speed.
    engine.kv_cache.load_costs.worth_loading = lambda block_size: True  # type: ignore[method-assign]
    if "kv_cache_memory" not in overrides and "kv_cache_dtype" not in overrides:
        assert engine.kv_pool.num_blocks == 20
    return engine


def _run(engine: LLMEngine, rid: str, prompt: list[int], **kw: Any) -> tuple[list[int], int]:
    """Generate greedily; (tokens, cached prompt tokens)."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    request = engine.make_request(rid, prompt, params, **kw)
    engine.add(request)
    tokens: list[int] = []
    cached = -1
    for _ in range(100_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    cached = out.num_cached_tokens
    else:
        raise AssertionError("the engine never finished")
    return tokens, cached


def _evict_all(engine: LLMEngine) -> None:
    """Drop every cached prefix from the pool (as pressure would)."""
    engine.kv_cache.pool.reset_prefix_cache()
    assert engine.kv_cache.pool.num_cached_blocks == 0


def _flush(engine: LLMEngine) -> None:
    assert engine.tier_io is not None
    engine.tier_io.flush()


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def test_evicted_prefix_is_loaded_not_recomputed(tiny_llama_dir: Path, tier_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, tier_dir)
    cold, cached = _run(engine, "a", PROMPT)
    assert cached == 0
    _flush(engine)
    state = engine.kv_cache.tier.state()
    assert state.num_blocks >= 12 and state.counters.stored_blocks >= 12
    _evict_all(engine)
    hot, cached = _run(engine, "b", PROMPT)
    assert hot == cold
    assert cached == 192  # 12 blocks, loaded from the tier and hit in the pool
    c = engine.kv_cache.tier.state().counters
    assert c.loads == 1 and c.loaded_blocks == 12 and c.failed_loads == 0
    assert engine.snapshot.kv_tier is not None and engine.snapshot.kv_tier.counters.loads == 1
    assert engine.kv_cache.pool.num_used_blocks == 0
    # /metrics shows it (the snapshot as the engine process pickles it to the front end).
    snap = pickle.loads(pickle.dumps(engine.snapshot))
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: {"tiny": snap}))
    text = generate_latest(registry).decode()
    assert 'kvgate:kv_tier_loads_total{model_name="tiny"} 1.0' in text
    assert 'kvgate:kv_tier_loaded_blocks_total{model_name="tiny"} 12.0' in text
    assert f'kvgate:kv_tier_blocks{{model_name="tiny"}} {float(c.stored_blocks)}' in text
    assert "kvgate:kv_tier_load_seconds_total" in text
    engine.close()


def test_tier_survives_a_restart_of_the_same_format(tiny_llama_dir: Path, tier_dir: Path) -> None:
    first = _engine(tiny_llama_dir, tier_dir)
    cold, _ = _run(first, "a", PROMPT)
    first.close()  # a clean shutdown writes everything pending
    second = _engine(tiny_llama_dir, tier_dir)
    assert second.kv_cache.tier.state().num_blocks >= 12
    hot, cached = _run(second, "a", PROMPT)
    assert (hot, cached) == (cold, 192)
    second.close()
    # Another KV dtype (or model, or weights) is another format: nothing found, recomputed.
    other = _engine(tiny_llama_dir, tier_dir, kv_cache_dtype="int8")
    assert other.kv_cache.tier.state().num_blocks == 0
    _, cached = _run(other, "a", PROMPT)
    assert cached == 0
    other.close()


def test_another_tenants_request_never_hits_the_tier(tiny_llama_dir: Path, tier_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, tier_dir)
    _run(engine, "a", PROMPT, tenant="acme", cache_salt=b"acme")
    _flush(engine)
    _evict_all(engine)
    _, cached = _run(engine, "b", PROMPT, tenant="globex", cache_salt=b"globex")
    assert cached == 0
    assert engine.kv_cache.tier.state().counters.loads == 0
    _evict_all(engine)
    _, cached = _run(engine, "c", PROMPT, tenant="acme", cache_salt=b"acme")
    assert cached == 192
    engine.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "swap"])
def test_a_damaged_file_is_skipped_and_recomputed(
    tiny_llama_dir: Path, tier_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(tiny_llama_dir, tier_dir)
    cold, _ = _run(engine, "a", PROMPT)
    _flush(engine)
    _evict_all(engine)
    assert engine.tier_io is not None
    folder = engine.tier_io.tier.dir
    files = sorted(folder.glob("*.kvb"), key=lambda p: p.stat().st_mtime_ns)
    victim = files[5]
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        victim.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    else:  # another block's file under this name
        victim.write_bytes(files[6].read_bytes())
    with caplog.at_level("WARNING", logger="kvgate.engine"):
        hot, cached = _run(engine, "b", PROMPT)
    assert hot == cold  # never loaded: recomputed
    assert "skipping" in caplog.text and victim.name in caplog.text
    _flush(engine)
    # Removed, then written again whole by the recompute (the same KV: the same bytes).
    assert victim.read_bytes() == data
    c = engine.kv_cache.tier.state().counters
    assert c.failed_loads == 1 and c.corrupt == 1
    assert cached < 192
    assert engine.kv_cache.pool.num_used_blocks == 0
    engine.kv_cache.pool.check_invariants()
    engine.close()


class _HeldExecutor(Executor):
    """Runs each submitted load only when released, on a thread of its own."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def run() -> None:
            self.started.set()
            self.release.wait(30)
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the future
                future.set_exception(exc)

        t = threading.Thread(target=run, daemon=True)
        self.threads.append(t)
        t.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.finish()

    def finish(self) -> None:
        """Let every held load run, and wait for them."""
        self.release.set()
        for t in self.threads:
            t.join(30)


def _held_loads(engine: LLMEngine) -> tuple[list[int], _HeldExecutor]:
    """``PROMPT`` run once (its tokens returned), its blocks then in the tier and out of the
    pool, and the tier's loads held until the executor's ``finish``."""
    cold, _ = _run(engine, "a", PROMPT)
    _flush(engine)
    _evict_all(engine)
    assert engine.tier_io is not None
    held = _HeldExecutor()
    engine.tier_io._loads = held
    return cold, held


def test_cancel_during_a_load_gives_every_block_back(tiny_llama_dir: Path, tier_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, tier_dir)
    cold, held = _held_loads(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine.add(engine.make_request("b", PROMPT, params))
    engine.add(engine.make_request("c", OTHER, params))
    engine.step()  # b starts loading; c is admitted and runs
    assert held.started.wait(30)
    assert engine.snapshot.kv_loading == 1
    assert engine.kv_cache.pool.num_used_blocks >= 12
    engine.abort(["b"])  # while its blocks are being written
    assert "b" not in engine.scheduler.requests and not engine.scheduler.loading
    assert engine.kv_cache.num_loading == 1  # still held: a thread writes them
    held.finish()
    while engine.has_unfinished():
        engine.step()
    engine.step()  # polls the finished load
    assert engine.kv_cache.num_loading == 0
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert engine.kv_cache.tenant_blocks == {}
    engine.kv_cache.pool.check_invariants()
    # The tier still serves the prefix afterwards.
    _evict_all(engine)
    engine.tier_io._loads = held  # released: runs at once
    hot, cached = _run(engine, "d", PROMPT)
    assert (hot, cached) == (cold, 192)
    engine.close()


def test_preempted_request_swaps_back_from_the_tier(tiny_llama_dir: Path, tier_dir: Path) -> None:
    """Two long requests in a pool that holds one: the preempted one's computed blocks were
    stored as they filled, and come back from the tier when its prefix left the pool."""
    engine = _engine(tiny_llama_dir, tier_dir)
    reference = _engine(tiny_llama_dir, tier_dir / "ref", kv_tier="none")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expect: dict[str, list[int]] = {}
    for rid, prompt in (("x", PROMPT), ("y", OTHER)):
        reference.add(reference.make_request(rid, prompt, params))
    while reference.has_unfinished():
        for out in reference.step():
            expect.setdefault(out.request_id, []).extend(out.new_token_ids)
    got: dict[str, list[int]] = {}
    for rid, prompt in (("x", PROMPT), ("y", OTHER)):
        engine.add(engine.make_request(rid, prompt, params))
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if engine.scheduler.num_preemptions and engine.kv_cache.pool.num_cached_blocks:
                _evict_all_free(engine)
    assert got == expect
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.tier.state().counters.loads > 0
    assert engine.kv_cache.pool.num_used_blocks == 0
    engine.close()


def _evict_all_free(engine: LLMEngine) -> None:
    engine.kv_cache.pool.reset_prefix_cache()


def test_blocks_cached_before_an_engine_error_are_never_stored_after_it(
    tiny_llama_dir: Path, tier_dir: Path
) -> None:
    """A step whose bookkeeping fails after its blocks were cached: the engine recovers
    (every request ended, the prefix cache reset) and those blocks, reused by the next
    request, must never reach the tier under the keys they held before."""
    reference = _engine(tiny_llama_dir, tier_dir / "ref", kv_tier="none")
    cold, _ = _run(reference, "a", PROMPT)
    engine = _engine(tiny_llama_dir, tier_dir, max_num_batched_tokens=256)
    kv = engine.kv_cache
    drop = kv._drop_out_of_window
    failed: list[bool] = []

    def fail_once(request: Any) -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("a bug in the step's bookkeeping")
        drop(request)

    kv._drop_out_of_window = fail_once  # type: ignore[method-assign]
    engine.add(engine.make_request("a", PROMPT, SamplingParams(max_tokens=6, temperature=0.0)))
    with pytest.raises(RuntimeError):
        engine.step()
    engine.recover(RuntimeError("recovered"))
    _run(engine, "b", OTHER)  # takes the same blocks, writes its own KV there
    _flush(engine)
    _evict_all(engine)
    hot, _ = _run(engine, "a2", PROMPT)
    assert hot == cold
    engine.close()


def test_requests_sharing_a_prefix_load_it_once(tiny_llama_dir: Path, tier_dir: Path) -> None:
    """After a restart, several requests with one cached prefix: one load, the others wait
    for it and hit the pool."""
    first = _engine(tiny_llama_dir, tier_dir, kv_cache_memory=80 * 8192)
    cold, _ = _run(first, "a", PROMPT)
    first.close()
    engine = _engine(tiny_llama_dir, tier_dir, kv_cache_memory=80 * 8192)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for i in range(4):
        engine.add(engine.make_request(f"r{i}", PROMPT, params))
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    assert all(tokens == cold for tokens in got.values()) and len(got) == 4
    assert all(n == 192 for n in cached.values())
    c = engine.kv_cache.tier.state().counters
    assert (c.loads, c.loaded_blocks) == (1, 12)
    engine.close()


def test_a_reused_request_id_is_not_given_the_old_loads_blocks(
    tiny_llama_dir: Path, tier_dir: Path
) -> None:
    """Abort a request while it loads, then add a new one of the same id that starts its
    own load: the old load's end must not release the new one early."""
    engine = _engine(tiny_llama_dir, tier_dir)
    cold, held = _held_loads(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine.add(engine.make_request("b", PROMPT, params))
    engine.step()
    assert held.started.wait(30) and engine.snapshot.kv_loading == 1
    engine.abort(["b"])
    engine.step()
    # The old load still runs (held): the pool still has its blocks; the new "b" plans a load
    # of its own, or waits for the one in flight.
    engine.add(engine.make_request("b", PROMPT, params))
    engine.step()
    assert "b" not in {r.request_id for r in engine.scheduler.running}
    held.finish()
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == cold
    engine.step()
    assert engine.kv_cache.num_loading == 0 and engine.kv_cache.pool.num_used_blocks == 0
    engine.kv_cache.pool.check_invariants()
    engine.close()
