"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Pure Python. One rule drives everything: each scheduled request's computed tokens catch up
with its known tokens, within a per-step token budget. Running requests go first (so decodes
are never starved by new prompts), then waiting ones in arrival order. When the pool runs
out of blocks, the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (mostly from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.messages import (
    NewRequestData,
    RunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from kvgate.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """The numbers the scheduler needs, and nothing else."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._sent_to_runner: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue changes
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests at once (abort, stop string, deadline): blocks go back immediately."""
        assert status.finished
        ended: list[Request] = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue  # already finished: aborting twice is harmless
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._end(request, status)
            ended.append(request)
        return ended

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = time.monotonic()
        self.kv_cache.free(request)
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        new_requests: list[NewRequestData] = []
        preempted: list[str] = []

        # 1. Running requests: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()  # newest admitted goes first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._sequence(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is left to schedule

        # 2. Waiting requests, in order, while budget, sequence slots and blocks allow.
        # After a preemption the pool is tight: admitting more would only thrash.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv_cache.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.request_id not in self._sent_to_runner:
                self._sent_to_runner.add(request.request_id)
                new_requests.append(
                    NewRequestData(request.request_id, request.prompt_token_ids, request.params)
                )
            scheduled.append(self._sequence(request, num_new))
            budget -= num_new

        finished = frozenset(self._finished_since_last_step)
        self._finished_since_last_step.clear()
        return SchedulerOutput(
            sequences=tuple(scheduled),
            new_requests=tuple(new_requests),
            finished_request_ids=finished,
            preempted_request_ids=tuple(preempted),
        )

    def _sequence(self, request: Request, num_new: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start:end]),
            start_pos=start,
            block_ids=tuple(self.kv_cache.block_ids(request.request_id)),
            sample=end == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, end requests that hit a token stop.

        Returns the requests that received a token this step (finished ones included).
        """
        touched: list[Request] = []
        for seq in output.sequences:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended or preempted after being scheduled
            request.num_computed_tokens += seq.num_tokens
            token = runner_output.sampled_token_ids.get(seq.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            touched.append(request)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.requests.pop(request.request_id)
                self.running.remove(request)
                self._end(request, status)
        return touched
