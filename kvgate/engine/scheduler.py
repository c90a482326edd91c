"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Pure Python. One rule drives everything: each scheduled request's computed tokens catch up
with its known tokens, within a per-step token budget. Running requests go first (so decodes
are never starved by new prompts), then waiting ones in arrival order. When the pool runs
out of blocks, the most recently admitted running request is preempted: its blocks are
freed and it is recomputed later (mostly from the prefix cache).

Spare slots: beyond ``max_num_seqs``, up to ``num_spare_seqs`` more sequences (by default
``max_num_seqs // 8``, at least 1) may run, but only requests the policy would preempt
someone for (a higher class, a tenant taking back its guarantee) take them, and they keep
them until they end. Preempting would throw away the victim's work and give the slot straight
back to the newcomer; running one more sequence costs a batch row. Only when the spare slots
are taken does a slot preemption happen.

Knobs: the step's token budget, the prefill chunk a request may take in one step, the running
sequences' cap and the tenants whose new work is held are ``knobs`` (``autopilot.Knobs``): the
configured values, unless the SLO autopilot moved them. A held tenant admits a new request
only while it has none running, so its class keeps progressing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvgate.engine.autopilot import Knobs
from kvgate.engine.drafter import NgramDrafter
from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.messages import (
    NewRequestData,
    RunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from kvgate.engine.offload import LoadOrder
from kvgate.engine.policy import FifoPolicy, Need, SchedulingPolicy, StepPlan, WaitingQueue
from kvgate.engine.request import Request, RequestStatus
from kvgate.errors import GRAMMAR_FAILED


@dataclass(frozen=True)
class SchedulerConfig:
    """The numbers the scheduler needs, and nothing else."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    #: None: ``max_num_seqs // 8``, at least 1 (see the module docstring).
    num_spare_seqs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_spare_seqs is not None and self.num_spare_seqs < 0:
            raise ValueError(f"num_spare_seqs must be >= 0, got {self.num_spare_seqs}")


@dataclass
class _Draft:
    """The step being scheduled: what is left of its token budget, and what it holds so far."""

    budget: int
    scheduled: dict[str, ScheduledSequence] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    #: Tenants that admit no more in this step: at their ceiling, or just preempted.
    blocked: set[str] = field(default_factory=set)
    #: Running requests preempted others to grow in this step (the pool is tight).
    grew: bool = False
    #: An urgent step (``Scheduler.schedule_urgent``): it runs inside the step in flight, so
    #: it preempts and refuses nobody, and takes a prompt whole or not at all.
    urgent: bool = False
    #: Requests ended because they can never run.
    refused: list[Request] = field(default_factory=list)

    def take(self, seq: ScheduledSequence) -> None:
        self.scheduled[seq.request_id] = seq
        self.budget -= seq.num_tokens


class Scheduler:
    """``policy`` decides order and entitlement (see ``engine/policy``); FIFO by default."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        policy: SchedulingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        drafter: NgramDrafter | None = None,
    ) -> None:
        """``drafter``: drafts for speculative decoding (None: no request speculates)."""
        self.config = config
        self.drafter = drafter
        self.kv_cache = kv_cache
        self.policy: SchedulingPolicy = policy if policy is not None else FifoPolicy()
        self.queue = self.policy.queue
        self.entitlement = self.policy.entitlement
        self.planner = self.policy.planner
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        #: Requests whose prefix is being loaded from the second KV tier (off the queue,
        #: holding blocks, computing nothing until ``load_done``).
        self.loading: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self._sent_to_runner: set[str] = set()
        self.num_preemptions = 0
        #: Sequences that may run beyond ``max_num_seqs`` (see the module docstring), and the
        #: ids of the running requests that hold them.
        self.num_spare_slots = (
            max(1, config.max_num_seqs // 8)
            if config.num_spare_seqs is None
            else config.num_spare_seqs
        )
        self.spare: set[str] = set()
        #: What the step runs with (the configured values unless the autopilot moved them).
        self.knobs = self.configured_knobs
        #: Preemptions by what forced them: "pool" (no free blocks), "quota" (a tenant's
        #: ceiling), "slot" (max_num_seqs and the spare slots taken, for a request of a
        #: higher class or one taking back its guarantee).
        self.preemptions_by_reason: dict[str, int] = {}
        #: Requests ever added, and ever ended (finished, aborted, refused, expired).
        self.num_added = 0
        self.num_finished = 0

    @property
    def configured_knobs(self) -> Knobs:
        c = self.config
        return Knobs(c.max_num_batched_tokens, c.max_num_batched_tokens, c.max_num_seqs)

    @property
    def waiting(self) -> WaitingQueue:
        """The waiting requests (the policy keeps them, in its own order)."""
        return self.queue

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ queue changes
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.planner.on_arrived(request)
        self.queue.add(request)
        self.num_added += 1

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
            elif self.loading.pop(rid, None) is None:
                self.queue.remove(request)
            self._end(request, status)
            ended.append(request)
        return ended

    def expire(self) -> list[Request]:
        """End requests past their deadlines: queued past the queue limit (refused) or running
        past the request deadline (ended with their output so far). Their blocks are free."""
        now = self.clock()
        queue_timeouts = [
            r.request_id
            for r in self.queue
            if r.queue_deadline is not None
            and r.queue_deadline < now
            and r.first_scheduled_time is None
        ]
        late = [
            r.request_id
            for r in self.requests.values()
            if r.deadline is not None and r.deadline < now
        ]
        ended = self.finish_requests(queue_timeouts, RequestStatus.FINISHED_QUEUE_TIMEOUT)
        return ended + self.finish_requests(late, RequestStatus.FINISHED_DEADLINE)

    def _end(self, request: Request, status: RequestStatus) -> None:
        self.num_finished += 1
        self.spare.discard(request.request_id)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        request.status = status
        request.finished_time = self.clock()
        self.kv_cache.free(request)
        self.planner.on_finished(request)
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)

    def load_done(self, order: LoadOrder, ok: bool) -> None:
        """A load from the second tier finished (``ok``: every block checked and read): the
        request goes back to the head of its queue and finds its prefix in the pool; a
        failed load is recomputed. A request that ended meanwhile gives its blocks back
        (a new request of the same id is not this load's)."""
        rid = order.request_id
        request = self.loading.get(rid)
        if request is not None and not self.kv_cache.is_loading(rid, order.load_id):
            request = None
        self.kv_cache.finish_load(request, order, ok)
        if request is not None:
            del self.loading[rid]
            request.tier_tried = True  # once: if the pool lost the blocks again, recompute
            self.queue.requeue(request)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        plan = self.planner.plan(self.running)
        self.planner.on_step(plan)
        step = _Draft(self.knobs.token_budget)
        if self.knobs.held:
            step.blocked |= self._held_busy()
        # 1. Running requests, in the plan's order (it may bench some for one step).
        self._run(step, plan.running)
        # 2. Waiting requests, in the policy's order, while budget, slots and blocks allow.
        while step.budget > 0:
            candidate = self.queue.pick(step.blocked, plan)
            if candidate is None or not self._consider(step, candidate, plan):
                break
        # A step set aside for a newcomer that could not be admitted after all would run
        # nothing: give the budget to the running requests instead.
        if not step.scheduled and self.running:
            self._run(step, list(self.running))
        # 3. Drafts, last: only from the budget and the free blocks every other sequence of
        # the step left (speculation never delays, starves or preempts anyone).
        if self.drafter is not None and not step.grew:
            self._add_drafts(step)
        return self._output(step)

    def schedule_urgent(self) -> SchedulerOutput | None:
        """A step to run inside the step in flight, between two of its layers, for the one
        waiting request the policy calls urgent (``Planner.urgent``); None if there is none.

        The same admission as a normal step's (``_consider``), in a step set aside for the
        request, but only what cannot disturb the step in flight: from free blocks, nothing
        preempted or refused, and the step in flight's requests left exactly as they are:

        - the request's whole prompt, so it ends with the first token, of up to twice the
          step's token budget (one longer step of its own delays the step in flight less
          than two chunks queued behind full steps would delay the request);
        - with every regular sequence slot taken, it takes a spare slot, as a normal step
          would, and only where a normal step would (the policy names a victim); with none
          spare it does not run (a normal step would have preempted for it).
        """
        candidate = self.planner.urgent(self.running)
        if candidate is None:
            return None
        self.planner.on_urgent_offered(candidate)
        if candidate.tenant in self._held_busy():
            return None
        step = _Draft(self.knobs.token_budget, urgent=True)
        self._consider(step, candidate, StepPlan((), candidate.tenant))
        return self._output(step) if step.scheduled else None

    def _output(self, step: _Draft) -> SchedulerOutput:
        """The drafted step, as the runner's message; its tenants charged for it."""
        for seq in step.scheduled.values():
            # A draft's rows are not charged: the tokens the model accepts are free.
            self.planner.on_scheduled(self.requests[seq.request_id], seq.num_tokens - seq.num_draft)
        finished: frozenset[str] = frozenset()
        if not step.urgent:  # the step in flight's runner still holds their state
            finished = frozenset(self._finished_since_last_step)
            self._finished_since_last_step.clear()
        return SchedulerOutput(
            sequences=tuple(step.scheduled.values()),
            new_requests=tuple(step.new_requests),
            finished_request_ids=finished,
            preempted_request_ids=tuple(step.preempted),
            refused=tuple(step.refused),
        )

    def _run(self, step: _Draft, order: Iterable[Request]) -> None:
        """Budget for running requests (decodes, prefill chunks), growing their blocks and
        preempting where they cannot grow (``step.grew``)."""
        kv = self.kv_cache
        for request in order:
            if step.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or request.request_id in step.scheduled:
                continue  # preempted earlier in this step, or already served
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if num_new > 1:  # a prefill chunk (a decode row is never cut)
                num_new = min(num_new, self.knobs.chunk_size)
            while True:
                extra = kv.num_blocks_to_add(request, num_new)
                need = self._need_of(request, extra)
                if need is None and kv.allocate_slots(request, num_new):
                    step.take(self._sequence(request, num_new))
                    break
                victim = self._victim(request, need or Need.POOL, extra, admitting=False)
                assert victim is not None and victim.status == RequestStatus.RUNNING
                self._preempt_for(step, victim, need or Need.POOL)
                step.grew = True
                if victim is request:
                    break

    def _add_drafts(self, step: _Draft) -> None:
        """Give the step's decodes drafts (``NgramDrafter``), in the step's order, while
        budget and free blocks last; each only as long as its rows pay
        (``NgramDrafter.worth``), judged against the step's decode rows so far."""
        assert self.drafter is not None
        kv = self.kv_cache
        decodes = [seq for seq in step.scheduled.values() if seq.num_tokens == 1]
        rows = tokens = float(len(decodes))
        for seq in decodes:
            if step.budget <= 0:
                break
            request = self.requests[seq.request_id]
            if request.num_tokens - request.num_computed_tokens != 1 or not (
                request.output_token_ids
            ):
                continue  # a one-token prompt chunk, or a first decode
            room = min(
                step.budget,
                request.params.max_tokens - request.num_output_tokens - 1,
                self.config.max_model_len - request.num_tokens - 1,
            )
            draft = self.drafter.propose(request, room)
            draft = draft[: self.drafter.worth(request.request_id, len(draft), int(rows), tokens)]
            if not draft:
                continue
            num = 1 + len(draft)
            extra = kv.num_blocks_to_add(request, num)
            if self._need_of(request, extra) is not None or not kv.allocate_slots(request, num):
                continue
            step.scheduled[seq.request_id] = self._sequence(request, 1, tuple(draft))
            step.budget -= len(draft)
            rows += len(draft)
            tokens += self.drafter.expected(request.request_id, len(draft))

    def _consider(self, step: _Draft, candidate: Request, plan: StepPlan) -> bool:
        """Admit the waiting ``candidate`` if it fits; else preempt for it, or leave its tenant
        out of this step. True: go on with the next waiting request; False: admit no more in
        this step (the pool or the slots are full).

        After preempting to let running requests grow, the pool is tight: admitting more would
        only thrash, unless the newcomer outranks running work (a policy victim).
        """
        kv = self.kv_cache
        hits, num_hit_tokens = kv.get_computed_blocks(candidate)
        if not step.urgent and not step.grew and self._load(step, candidate, num_hit_tokens):
            return True
        num_new = candidate.num_tokens - num_hit_tokens
        # In a step set aside for it, a prompt of up to twice the budget goes whole, as in an
        # urgent step: it ends with the first token, where a chunk would leave the rest to the
        # next step, behind a full step of other work.
        # Otherwise a prefill takes at most a chunk (``knobs.chunk_size``); while the autopilot
        # has cut the chunk below the budget, a prompt never goes whole beyond it either.
        knobs = self.knobs
        limit = min(step.budget, knobs.chunk_size)
        whole = plan.owns(candidate) and knobs.chunk_size >= knobs.token_budget
        room = limit + (knobs.token_budget if whole else 0)
        if step.urgent and not 0 < num_new <= room:
            return False  # whole or not at all
        if num_new > room:
            num_new = limit
        extra = kv.num_blocks_to_add(candidate, num_new, hits)
        if step.grew and self._victim(candidate, Need.POOL, extra, admitting=True) is None:
            step.blocked.add(candidate.tenant)
            return True
        takes_spare = self._slots_full()  # every regular slot is taken: it needs a spare one
        if takes_spare:
            victim = self._victim(candidate, Need.SLOT, extra, admitting=True)
            if victim is None:
                return False
            if len(self.spare) >= self.num_spare_slots:
                if step.urgent:
                    return False  # it would preempt: a normal step's business
                self._preempt_for(step, victim, Need.SLOT)
                return True
        need = self._need_of(candidate, extra)
        if need is None and kv.allocate_slots(candidate, num_new, hits):
            self._admit(candidate, num_hit_tokens, step.new_requests, takes_spare)
            step.take(self._sequence(candidate, num_new))
            if candidate.tenant in self.knobs.held:
                step.blocked.add(candidate.tenant)  # held: one request running at a time
            return True
        if step.urgent:
            return False  # a normal step preempts or refuses for it, if anything
        victim = self._victim(candidate, need or Need.POOL, extra, admitting=True)
        if victim is not None:
            self._preempt_for(step, victim, need or Need.POOL)
        elif need is Need.QUOTA and not kv.tenant_blocks.get(candidate.tenant):
            # Over its tenant's ceiling with the tenant holding nothing: it can never run (the
            # ceiling was lowered under it). End it rather than let it wait for ever.
            candidate.error = f"the request needs {extra} KV blocks, over its tenant's kv_ceiling"
            self.finish_requests([candidate.request_id], RequestStatus.FINISHED_ERROR)
            step.refused.append(candidate)
        elif need is Need.QUOTA:
            step.blocked.add(candidate.tenant)  # at its ceiling: other tenants may still go
        else:
            return False  # the pool is full: later requests wait their turn
        return True

    def _load(self, step: _Draft, candidate: Request, num_hit_tokens: int) -> bool:
        """Start loading the part of ``candidate``'s prefix that the second tier holds and the
        pool does not, where that beats recomputing it, within its tenant's ceiling, from
        free blocks that leave one for each running sequence to grow into (a load takes its
        whole prefix at once, where a prefill takes a chunk a step: it must not force
        preemptions); else it is recomputed as usual. True: it is loading, or it waits for
        its prefix that another request's load is bringing in (its tenant admits no more in
        this step)."""
        kv = self.kv_cache
        if candidate.tier_tried or not kv.tier_enabled:
            return False
        plan = kv.tier_plan(candidate, num_hit_tokens)
        if plan is None:
            return False
        if plan.in_flight:
            step.blocked.add(candidate.tenant)
            return True
        extra = sum(1 for t in plan.tables for e in t if e is not None)
        if extra + len(self.running) > kv.pool.num_free_blocks:
            return False
        if self._need_of(candidate, extra) is not None or not kv.start_load(candidate, plan):
            return False
        self.queue.remove(candidate)
        self.loading[candidate.request_id] = candidate
        return True

    def _victim(
        self, request: Request, need: Need, extra: int, *, admitting: bool
    ) -> Request | None:
        """The policy's victim for ``request``, which needs ``extra`` more blocks: a waiting
        request to admit (``admitting``) or a running one that must grow."""
        return self.entitlement.victim(
            request, self.running, self.kv_cache.tenant_blocks, need,
            admitting=admitting, extra_blocks=extra,
        )  # fmt: skip

    def _preempt_for(self, step: _Draft, victim: Request, need: Need) -> None:
        """Preempt ``victim`` in the step being drafted: a sequence it had there gives its
        budget back, and its tenant admits no more in this step (a request preempted in a step
        is never re-admitted in the same step)."""
        self.preemptions_by_reason[need.value] = self.preemptions_by_reason.get(need.value, 0) + 1
        seq = step.scheduled.pop(victim.request_id, None)
        if seq is not None:
            step.budget += seq.num_tokens
        self.running.remove(victim)
        self._preempt(victim)
        step.preempted.append(victim.request_id)
        step.blocked.add(victim.tenant)

    def _slots_full(self) -> bool:
        """Every regular slot (``knobs.max_running``, ``max_num_seqs`` unless moved) is taken."""
        return len(self.running) - len(self.spare) >= self.knobs.max_running

    def _held_busy(self) -> set[str]:
        """Held tenants (``knobs.held``) that have a request running: they admit nothing new."""
        held = self.knobs.held
        return {r.tenant for r in self.running if r.tenant in held}

    def _need_of(self, request: Request, extra_blocks: int) -> Need | None:
        """What stops ``request`` from holding ``extra_blocks`` more (None: nothing)."""
        kv = self.kv_cache
        held = kv.tenant_blocks.get(request.tenant, 0)
        if not self.entitlement.may_hold(request.tenant, held + extra_blocks):
            return Need.QUOTA
        if extra_blocks > kv.pool.num_free_blocks:
            return Need.POOL
        return None

    def _admit(
        self,
        request: Request,
        num_hit_tokens: int,
        new_requests: list[NewRequestData],
        spare: bool = False,
    ) -> None:
        """``spare``: it runs in a spare slot, until it ends or is preempted."""
        self.queue.remove(request)
        self.kv_cache.record_prefix_lookup(request.tenant, request.num_tokens, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if spare:
            self.spare.add(request.request_id)
        if request.request_id not in self._sent_to_runner:
            self._sent_to_runner.add(request.request_id)
            new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    request.matcher,
                    request.lora,
                )
            )

    def _sequence(
        self, request: Request, num_new: int, draft: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        start = request.num_computed_tokens
        end = start + num_new
        if start < request.num_prompt_tokens:
            request.prefill_chunks.append((self.clock(), num_new))
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=(*request.all_token_ids[start:end], *draft),
            start_pos=start,
            tables=self.kv_cache.block_ids(request.request_id),
            sample=end == request.num_tokens,
            num_draft=len(draft),
        )

    def _preempt(self, request: Request) -> None:
        self.spare.discard(request.request_id)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.tier_tried = False  # its blocks may be swapped back in from the tier
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.queue.requeue(request)

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens (after a speculating sequence's
        accepted draft tokens), end requests that hit a token stop.

        Returns the requests that received a token this step (finished ones included).
        """
        touched: list[Request] = []
        for seq in output.sequences:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended or preempted after being scheduled
            # The draft's rows are computed only as far as the model accepted them.
            request.num_computed_tokens += seq.num_tokens - seq.num_draft
            tokens = runner_output.new_tokens(seq.request_id)
            status = self._append(request, tokens, runner_output) if tokens else None
            self.kv_cache.commit(request)
            if seq.num_draft:
                self.kv_cache.trim(request)
                if self.drafter is not None:
                    accepted = len(runner_output.accepted.get(seq.request_id, ()))
                    self.drafter.record(seq.request_id, seq.num_draft, accepted)
            if tokens:
                touched.append(request)
            if status is not None:
                self.requests.pop(request.request_id)
                self.running.remove(request)
                self._end(request, status)
        return touched

    def _append(
        self, request: Request, tokens: tuple[int, ...], runner_output: RunnerOutput
    ) -> RequestStatus | None:
        """Append ``tokens`` one by one, stopping at the first that ends the request (the
        rest of an accepted draft is dropped: the request never produced it). Every token
        but the first is an accepted draft token whose KV the step wrote: it counts as
        computed. Returns the status that ends the request, if one does."""
        rid = request.request_id
        for i, token in enumerate(tokens):
            if i:
                request.num_computed_tokens += 1
            request.append_output_token(token)
            status: RequestStatus | None = None
            if i == len(tokens) - 1:  # the grammar's verdicts are on the last token
                failed = runner_output.grammar_failed.get(rid)
                if failed is not None:
                    request.error = f"{GRAMMAR_FAILED}{failed}"
                    return RequestStatus.FINISHED_ERROR
                if rid in runner_output.grammar_complete:
                    return RequestStatus.FINISHED_STOPPED
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                return status
        return None
