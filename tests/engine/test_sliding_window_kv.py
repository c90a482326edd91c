"""Sliding-window KV groups under the real scheduler: blocks that no window reads go back to
the pool as sequences grow, and none that a window still reads ever does (with chunked
prefill, prefix hits, preemption and aborts)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.messages import RunnerOutput, SchedulerOutput
from kvgate.engine.request import RequestStatus
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.model.kv_layout import KVGroup, KVLayout
from tests.engine.fakes import assert_pool_whole, make_request

# Gemma 3's shape in small: a global group and two sliding ones, two layers a block.
WINDOW = 10
LAYOUT = KVLayout(
    (KVGroup((2, 5), None), KVGroup((0, 1), WINDOW), KVGroup((3, 4), WINDOW)), slots=2
)


class WindowRunner:
    """Checks every step against the tables: each token's K/V has a block in every group,
    and every key a query reads (all earlier ones globally, the last ``WINDOW`` in a
    sliding group) is held."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        self.bs = block_size
        self.rng = random.Random(seed)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for seq in out.sequences:
            for group, table in zip(LAYOUT.groups, seq.tables, strict=True):
                first_query = seq.start_pos
                lo = 0 if group.window is None else max(first_query - group.window + 1, 0)
                for pos in range(lo, seq.context_len):
                    assert table[pos // self.bs] >= 0, (seq.request_id, group, pos)
        sampled = {s.request_id: self.rng.randrange(40) for s in out.sequences if s.sample}
        return RunnerOutput(sampled_token_ids=sampled)


def _scheduler(num_blocks: int, block_size: int, budget: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, layout=LAYOUT)
    cfg = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=num_blocks * block_size // 4
    )
    return Scheduler(cfg, kv)


def _check(sched: Scheduler, block_size: int, budget: int) -> None:
    kv = sched.kv_cache
    kv.pool.check_invariants()
    kv.check_windows(sched.running)
    holders: dict[int, int] = {}
    for rid, tables in kv.req_blocks.items():
        for g, (group, table) in enumerate(zip(LAYOUT.groups, tables, strict=True)):
            held = [b for b in table if b is not None]
            if group.window is not None:  # O(window), whatever the length
                assert len(held) <= -(-(WINDOW - 1 + budget) // block_size) + 1, (rid, g)
            for b in held:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 24),
    num_blocks=st.integers(60, 160),
)
def test_no_block_a_window_reads_is_ever_freed(
    seed: int, block_size: int, budget: int, num_blocks: int
) -> None:
    rng = random.Random(seed)
    sched = _scheduler(num_blocks, block_size, budget)
    runner = WindowRunner(block_size, seed)
    max_len = sched.config.max_model_len
    shared = [rng.randrange(40) for _ in range(max_len // 2)]  # prefixes to hit in the cache
    n = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.15 and n < 40:
            prompt_len = rng.randrange(1, max_len // 2)
            fresh = [rng.randrange(40) for _ in range(prompt_len)]
            prompt = shared[:prompt_len] if rng.random() < 0.5 else fresh
            new = rng.randrange(1, max_len - prompt_len + 1)
            sched.add_request(make_request(f"r{n}", prompt, max_tokens=new))
            n += 1
        elif action < 0.2 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        _check(sched, block_size, budget)
    steps = 0
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        _check(sched, block_size, budget)
        steps += 1
        assert steps < 20_000
    assert_pool_whole(sched)


def test_a_long_generation_holds_its_window_in_sliding_groups() -> None:
    """A 4x-window generation: the global group grows with the sequence, each sliding group
    stays within its window (plus the block being written), and what was given back is
    counted."""
    bs = 4
    sched = _scheduler(num_blocks=200, block_size=bs, budget=8)
    runner = WindowRunner(bs)
    sched.add_request(make_request("long", list(range(8)), max_tokens=4 * WINDOW * 4))
    peaks = [0, 0, 0]
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        for g, table in enumerate(sched.kv_cache.req_blocks.get("long", [])):
            peaks[g] = max(peaks[g], sum(1 for b in table if b is not None))
    total = 8 + 4 * WINDOW * 4
    assert peaks[0] == -(-total // bs)
    assert peaks[1] <= -(-(WINDOW - 1 + 8) // bs) + 1 and peaks[2] == peaks[1]
    assert sched.kv_cache.num_window_freed >= 2 * (-(-total // bs) - peaks[1])


def test_a_prefix_hit_takes_only_the_window_of_a_sliding_group() -> None:
    bs = 4
    sched = _scheduler(num_blocks=200, block_size=bs, budget=64)
    runner = WindowRunner(bs)
    prompt = list(range(40))
    sched.add_request(make_request("first", prompt, max_tokens=1))
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    again = make_request("again", [*prompt, 99, 98], max_tokens=1)
    hit, tokens = sched.kv_cache.get_computed_blocks(again)
    assert tokens == 40
    assert all(b is not None for b in hit[0])  # the global group: every block
    first_read = (40 - WINDOW + 1) // bs
    for table in hit[1:]:
        assert all(b is None for b in table[:first_read])
        assert all(b is not None for b in table[first_read:])
