from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.autopilot import Knobs
from kvgate.engine.policy import TenantFairPolicy, TenantShare
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.scheduler import Scheduler
from kvgate.sampling_params import SamplingParams
from tests.engine.fakes import (
    FakeRunner,
    assert_pool_whole,
    make_request,
    make_scheduler,
    run_to_completion,
)


def test_long_prompt_is_prefilled_in_chunks_within_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=64)
    sched.add_request(make_request("a", list(range(40)), max_tokens=2))
    runner = FakeRunner()
    out = sched.schedule()
    assert [s.num_tokens for s in out.sequences] == [16]
    assert not out.sequences[0].sample  # a chunk short of the end samples nothing
    sched.update(out, runner.execute(out))
    out = sched.schedule()
    assert out.sequences[0].start_pos == 16 and out.sequences[0].num_tokens == 16
    sched.update(out, runner.execute(out))
    out = sched.schedule()
    assert out.sequences[0].num_tokens == 8 and out.sequences[0].sample
    sched.update(out, runner.execute(out))
    assert sched.requests["a"].num_output_tokens == 1


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.add_request(make_request("b", list(range(30)), max_tokens=5))
    out = sched.schedule()
    sizes = {s.request_id: s.num_tokens for s in out.sequences}
    assert sizes == {"a": 1, "b": 9}  # the decode first, the chunk takes the rest of the budget
    assert out.num_batched_tokens <= 10


def test_prefix_cache_hit_skips_cached_blocks_but_leaves_one_token() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner()
    prompt = list(range(12))  # exactly three full blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out = sched.schedule()
    (seq,) = out.sequences
    # Two blocks reused; the last block is recomputed so the step yields logits.
    assert seq.start_pos == 8 and seq.num_tokens == 4
    assert sched.requests["b"].num_cached_tokens == 8
    sched.update(out, runner.execute(out))
    assert_pool_whole(sched)


def test_different_salts_do_not_share_prefix() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner()
    prompt = list(range(12))
    a = make_request("a", prompt, max_tokens=1)
    a.cache_salt = b"tenant-a"
    sched.add_request(a)
    run_to_completion(sched, runner)
    b = make_request("b", prompt, max_tokens=1)
    b.cache_salt = b"tenant-b"
    sched.add_request(b)
    out = sched.schedule()
    assert out.sequences[0].start_pos == 0


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens each need 2 blocks, then grow.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner()
    sched.add_request(make_request("a", list(range(8)), max_tokens=12))
    sched.add_request(make_request("b", list(range(100, 108)), max_tokens=12))
    preempted: list[str] = []
    steps = 0
    while sched.num_unfinished:
        out = sched.schedule()
        preempted += out.preempted_request_ids
        sched.update(out, runner.execute(out))
        steps += 1
        assert steps < 500
    assert preempted and preempted[0] == "b"  # the newest running request goes first
    assert_pool_whole(sched)


def test_abort_frees_blocks_immediately_in_any_state() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner()
    sched.add_request(make_request("run", list(range(20)), max_tokens=50))
    sched.add_request(make_request("wait", list(range(20)), max_tokens=50))
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    used = sched.kv_cache.pool.num_used_blocks
    assert used > 0
    ended = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["run", "wait"]
    assert_pool_whole(sched)
    # The runner learns about the aborted request on the next step, so it can drop its state.
    assert sched.schedule().finished_request_ids == frozenset({"run"})


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=100)
    for i in range(5):
        sched.add_request(make_request(str(i), [i, i + 1], max_tokens=3))
    out = sched.schedule()
    assert len(out.sequences) == 3


def test_cancel_storm_leaks_no_blocks() -> None:
    """100 requests, 30 aborted at random points: the pool is whole at the end."""
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=80, block_size=4, max_num_seqs=16, max_num_batched_tokens=48)
    runner = FakeRunner(seed=3)
    shared = [rng.randrange(50) for _ in range(8)]  # a shared prefix to exercise the cache
    for i in range(100):
        prompt = shared + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
    to_abort = set(rng.sample(range(100), 30))
    steps = 0
    while sched.num_unfinished:
        live = [rid for rid in sched.requests if int(rid[1:]) in to_abort]
        if live and rng.random() < 0.3:
            victim = rng.choice(live)
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            to_abort.discard(int(victim[1:]))
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        sched.kv_cache.pool.check_invariants()
        steps += 1
        assert steps < 5000
    assert_pool_whole(sched)


def _check_ownership(sched: Scheduler) -> None:
    """Each block's ref count equals the number of requests holding it; only cached blocks
    are shared, and no request holds a block twice."""
    pool = sched.kv_cache.pool
    pool.check_invariants()
    holders: dict[int, int] = {}
    for rid in sched.kv_cache.req_blocks:
        ids = [b.block_id for b in sched.kv_cache.held_blocks(rid)]
        assert len(ids) == len(set(ids))
        for i in ids:
            holders[i] = holders.get(i, 0) + 1
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert block.ref_count >= 0
        if block.ref_count > 1:
            assert block.block_hash is not None


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    actions,
    st.integers(8, 40),  # pool size in blocks
    st.sampled_from([2, 4, 8]),  # block size
    st.integers(4, 40),  # token budget
)
def test_block_ownership_under_random_requests_and_aborts(
    program: list[tuple[object, ...]], num_blocks: int, block_size: int, budget: int
) -> None:
    """Random adds, aborts and steps: ownership invariants hold after every action, and once
    everything has ended or been aborted, every block that is not a cached prefix is free."""
    max_model_len = (num_blocks * block_size) // 2
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )
    runner = FakeRunner(vocab=4, block_size=block_size)  # tiny vocab: many shared prefixes
    n = 0
    for act in program:
        if act[0] == "add":
            plen, max_tokens, shared = int(act[1]), int(act[2]), bool(act[3])  # type: ignore[call-overload]
            plen = min(plen, max_model_len - max_tokens)
            if plen <= 0:
                continue
            prompt = [1] * plen if shared else [(n + i) % 4 for i in range(plen)]
            sched.add_request(make_request(f"q{n}", prompt, max_tokens=max_tokens))
            n += 1
        elif act[0] == "abort" and sched.requests:
            ids = sorted(sched.requests)
            sched.finish_requests([ids[int(act[1]) % len(ids)]], RequestStatus.FINISHED_ABORTED)  # type: ignore[call-overload]
        elif act[0] == "step":
            for _ in range(int(act[1])):  # type: ignore[call-overload]
                out = sched.schedule()
                sched.update(out, runner.execute(out))
        _check_ownership(sched)
    run_to_completion(sched, runner)
    _check_ownership(sched)
    assert_pool_whole(sched)


def test_prefix_counters_count_each_admission_once() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner()
    # "big" holds 6-8 of the 8 blocks, so "b" (3 blocks) retries admission for several steps.
    sched.add_request(make_request("big", list(range(100, 124)), max_tokens=8))
    sched.add_request(make_request("b", list(range(12)), max_tokens=1))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["big"]
    sched.update(out, runner.execute(out))
    run_to_completion(sched, runner)
    assert sched.kv_cache.prefix_queries == 24 + 12
    assert sched.kv_cache.prefix_hits == 0
    sched.add_request(make_request("b2", list(range(12)), max_tokens=1))
    run_to_completion(sched, runner)
    assert sched.kv_cache.prefix_queries == 24 + 12 + 12
    assert sched.kv_cache.prefix_hits == 8  # b2 reused b's first two blocks


# ---------------------------------------------------------------- knobs (the SLO autopilot's)
def test_knobs_cap_the_budget_the_prefill_chunk_and_the_running_sequences() -> None:
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    assert sched.knobs == Knobs(64, 64, 8)
    sched.knobs = Knobs(token_budget=40, chunk_size=16, max_running=2)
    runner = FakeRunner()
    for i in range(4):
        sched.add_request(make_request(f"r{i}", list(range(1, 51)), max_tokens=3))
    out = sched.schedule()
    # Two sequences at most, each prompt in chunks of 16, within the 40-token budget.
    assert [s.num_tokens for s in out.sequences] == [16, 16]
    sched.update(out, runner.execute(out))
    while sched.num_unfinished:
        out = sched.schedule()
        assert out.num_batched_tokens <= 40 and len(out.sequences) <= 2
        assert all(s.num_tokens <= 16 for s in out.sequences)
        sched.update(out, runner.execute(out))
    assert_pool_whole(sched)


def test_a_held_tenant_runs_one_request_at_a_time_and_keeps_progressing() -> None:
    shares = {"chat": TenantShare(priority=0), "bulk": TenantShare(priority=2)}
    policy = TenantFairPolicy(shares, TenantShare())
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)
    sched.knobs = Knobs(64, 64, 8, held=frozenset({"bulk"}))
    runner = FakeRunner()
    for i in range(3):
        sched.add_request(Request(f"b{i}", [1, 2, 3], SamplingParams(max_tokens=4), tenant="bulk"))
        sched.add_request(Request(f"c{i}", [4, 5, 6], SamplingParams(max_tokens=4), tenant="chat"))
    finished_bulk = 0
    while sched.num_unfinished:
        out = sched.schedule()
        running_bulk = [r for r in sched.running if r.tenant == "bulk"]
        assert len(running_bulk) <= 1  # held: one at a time
        sched.update(out, runner.execute(out))
        finished_bulk = sum(1 for i in range(3) if f"b{i}" not in sched.requests)
    assert finished_bulk == 3  # every held request ran in the end
    assert_pool_whole(sched)
