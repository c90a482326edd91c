"""Compressed KV layouts (DeepSeek-V4's) under the real scheduler: a sliding group of the
per-token stream and a global group of entries whose blocks span several base blocks. Every
position a step reads and every entry block up to its context is held; blocks out of the
window go back; prefix hits are whole blocks of both groups; the pool ends whole (with
chunked prefill, prefix hits and aborts)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.messages import RunnerOutput, SchedulerOutput
from kvgate.engine.request import RequestStatus
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.errors import UnsupportedModel
from kvgate.model.kv_layout import KVLayout
from kvgate.model.kv_spec import KVSpec
from tests.engine.fakes import assert_pool_whole, make_request

WINDOW = 16  # the largest layer's: a rate-16 layer reads its last compression window


def _layout(block_size: int) -> KVLayout:
    return KVLayout.for_specs(
        [
            KVSpec.compressed(8, 40, 4, 12, dtype="float32"),  # sparse: 2 x 4 = 8
            KVSpec.compressed(8, 10, None, 0, dtype="float32"),  # the window alone
            KVSpec.compressed(WINDOW, 30, 16, 10, dtype="float32"),  # heavily compressed
        ],
        block_size,
    )


class StreamRunner:
    """Checks every step against the tables: each position the step writes or reads (the
    layout's window back from its first query) has a token block, and every entry block
    up to the context's end an entry block."""

    def __init__(self, layout: KVLayout, block_size: int, seed: int = 0) -> None:
        self.layout, self.bs = layout, block_size
        self.rng = random.Random(seed)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        span = self.layout.groups[1].span * self.bs
        for seq in out.sequences:
            tokens, entries = seq.tables
            for pos in range(max(seq.start_pos - WINDOW + 1, 0), seq.context_len):
                assert tokens[pos // self.bs] >= 0, (seq.request_id, pos)
            assert len(entries) >= -(-seq.context_len // span)
            assert all(b >= 0 for b in entries[: -(-seq.context_len // span)])
        sampled = {s.request_id: self.rng.randrange(40) for s in out.sequences if s.sample}
        return RunnerOutput(sampled_token_ids=sampled)


def _scheduler(layout: KVLayout, num_blocks: int, block_size: int, budget: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, layout=layout)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=300)
    return Scheduler(cfg, kv)


def test_the_layout_pairs_a_window_group_with_an_entry_group() -> None:
    layout = _layout(4)
    window, entries = layout.groups
    assert window.layers == (0, 1, 2) and window.window == WINDOW and window.span == 1
    assert entries.layers == (0, 2) and entries.window is None and entries.entries
    # Whole entries of every layer a block: 16-token windows need 4 base blocks of 4.
    assert entries.span % 4 == 0
    tokens = entries.span * 4
    assert layout.page_rows(1, 0, 4) == tokens // 4 and layout.page_rows(1, 2, 4) == tokens // 16
    token_block = 4 * (40 + 10 + 30) * 4
    entry_block = (tokens // 4 * 12 + tokens // 16 * 10) * 4
    assert layout.block_bytes(4) == max(token_block, entry_block)
    assert layout.reuse_span == entries.span


def test_mixing_compressed_layers_with_others_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="compressed"):
        KVLayout.for_specs([KVSpec.compressed(8, 10, 4, 12), KVSpec.attention(1, 10)])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([2, 4, 8, 16]),
    budget=st.integers(4, 40),
    num_blocks=st.integers(40, 120),
)
def test_no_block_a_step_reads_is_ever_freed(
    seed: int, block_size: int, budget: int, num_blocks: int
) -> None:
    rng = random.Random(seed)
    layout = _layout(block_size)
    sched = _scheduler(layout, num_blocks, block_size, budget)
    kv = sched.kv_cache
    runner = StreamRunner(layout, block_size, seed)
    shared = [rng.randrange(40) for _ in range(150)]  # prefixes to hit in the cache
    unit = layout.reuse_span * block_size
    n = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.15 and n < 30:
            prompt_len = rng.randrange(1, 150)
            fresh = [rng.randrange(40) for _ in range(prompt_len)]
            prompt = shared[:prompt_len] if rng.random() < 0.6 else fresh
            request = make_request(f"r{n}", prompt, max_tokens=rng.randrange(1, 100))
            _, hit = kv.get_computed_blocks(request)
            assert hit % unit == 0  # whole blocks of both groups
            sched.add_request(request)
            n += 1
        elif action < 0.2 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        kv.pool.check_invariants()
        kv.check_windows(sched.running)
    steps = 0
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        kv.check_windows(sched.running)
        steps += 1
        assert steps < 20_000
    assert_pool_whole(sched)


def test_a_long_generation_holds_its_window_and_its_entry_blocks() -> None:
    bs = 4
    layout = _layout(bs)
    sched = _scheduler(layout, num_blocks=200, block_size=bs, budget=8)
    runner = StreamRunner(layout, bs)
    sched.add_request(make_request("long", list(range(8)), max_tokens=280))
    span = layout.groups[1].span * bs
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        tables = sched.kv_cache.req_blocks.get("long")
        if tables is None:
            continue
        computed = sched.requests["long"].num_computed_tokens
        window = sum(b is not None for b in tables[0])
        assert window <= -(-(WINDOW - 1 + 8) // bs) + 1
        assert sum(b is not None for b in tables[1]) == -(-max(computed, 1) // span)


def test_a_prefix_hit_is_whole_entry_blocks_and_the_window_before_it() -> None:
    bs = 4
    layout = _layout(bs)
    unit = layout.reuse_span * bs
    sched = _scheduler(layout, num_blocks=200, block_size=bs, budget=64)
    runner = StreamRunner(layout, bs)
    prompt = [i % 37 for i in range(2 * unit + 5)]
    sched.add_request(make_request("first", prompt, max_tokens=1))
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    again = make_request("again", [*prompt, 99], max_tokens=1)
    hit, tokens = sched.kv_cache.get_computed_blocks(again)
    assert tokens == 2 * unit
    window, entries = hit
    assert len(entries) == 2 and all(b is not None for b in entries)
    first_read = (tokens - WINDOW + 1) // bs
    assert all(b is None for b in window[:first_read])
    assert all(b is not None for b in window[first_read:]) and len(window) == tokens // bs
