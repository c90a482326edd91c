"""A fake model runner behind the real scheduler interface: random tokens, no tensors."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.messages import RunnerOutput, SchedulerOutput
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.step_handle import RunnerStep
from kvgate.sampling_params import SamplingParams


class FakeRunner:
    """Samples a random token for every sequence that asks for one; checks the batch shape."""

    def __init__(self, vocab: int = 50, seed: int = 0, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.block_size = block_size
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        for seq in out.sequences:
            # Every token of the step must have a slot in the sequence's block table.
            assert seq.context_len <= len(seq.block_ids) * self.block_size, seq
        return RunnerOutput(
            sampled_token_ids={
                s.request_id: self.rng.randrange(self.vocab) for s in out.sequences if s.sample
            }
        )

    def start(self, out: SchedulerOutput, pause: bool = False) -> RunnerStep:
        return RunnerStep.done(self.execute(out))


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    enable_prefix_caching: bool = True,
    policy: SchedulingPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    return Scheduler(cfg, kv, policy, clock)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **kw: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def assert_pool_whole(sched: Scheduler) -> None:
    """After every request has ended, every block is free (cached prefixes may remain)."""
    pool = sched.kv_cache.pool
    pool.check_invariants()
    assert not sched.kv_cache.req_blocks
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


__all__ = [
    "FakeRunner",
    "RequestStatus",
    "assert_pool_whole",
    "make_request",
    "make_scheduler",
    "run_to_completion",
]
