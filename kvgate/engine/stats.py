"""What the engine reports about itself: per-request timelines and per-step events.

The engine fills these in; listeners (the Prometheus exporter, tests) receive them after each
step through the ``StatsListener`` protocol, so the engine knows nothing of any metrics library.
All times are ``time.monotonic()`` seconds; durations are seconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.engine.request import Request


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request's timeline: where its wall time went.

    queue: arrival -> first scheduled; prefill: first scheduled -> first token;
    decode: first token -> finish. A phase that never happened (aborted while queued) is 0.
    """

    arrival_time: float
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    e2e_seconds: float
    num_preemptions: int
    peak_kv_blocks: int = 0
    #: KV blocks held times seconds over the request's life.
    kv_block_seconds: float = 0.0
    #: The same timeline as instants (time.monotonic()); None for a phase never reached.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_chunks: tuple[tuple[float, int], ...] = ()

    @classmethod
    def of(cls, request: Request, now: float) -> RequestMetrics:
        end = request.finished_time if request.finished_time is not None else now
        scheduled = request.first_scheduled_time
        first_token = request.first_token_time
        queue_end = scheduled if scheduled is not None else end
        prefill_end = first_token if first_token is not None else end
        return cls(
            arrival_time=request.arrival_time,
            queue_seconds=max(queue_end - request.arrival_time, 0.0),
            prefill_seconds=max(prefill_end - queue_end, 0.0) if scheduled is not None else 0.0,
            decode_seconds=max(end - first_token, 0.0) if first_token is not None else 0.0,
            e2e_seconds=max(end - request.arrival_time, 0.0),
            num_preemptions=request.num_preemptions,
            peak_kv_blocks=request.peak_kv_blocks,
            kv_block_seconds=request.kv_block_seconds,
            first_scheduled_time=scheduled,
            first_token_time=first_token,
            finished_time=end,
            prefill_chunks=tuple(request.prefill_chunks),
        )


@dataclass(frozen=True)
class FinishedRequestStats:
    request_id: str
    tenant: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass
class IterationStats:
    """What happened in one engine step."""

    step_seconds: float = 0.0
    #: Prompt tokens of requests that produced their first token in this step.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    #: Sequences in the step's batch and tokens the model ran over.
    batch_size: int = 0
    num_batched_tokens: int = 0
    #: "prefill" (only prompt chunks), "decode" (only one-token decodes), "mixed", or "idle".
    phase: str = "idle"
    #: Ran between two layers of another step (``LLMEngine.step_urgent``): its wall time is
    #: also inside that step's ``step_seconds``.
    inside_step: bool = False
    #: Speculative decoding (``engine/drafter.py``): drafts verified in the step, their
    #: tokens, and the draft tokens the model accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_tokens_by_tenant: Counter[str] = field(default_factory=Counter)
    generation_tokens_by_tenant: Counter[str] = field(default_factory=Counter)
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    #: The tenant of each sample above, index for index (the SLO autopilot's groups).
    ttft_tenants: list[str] = field(default_factory=list)
    itl_tenants: list[str] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class TenantLedger:
    """Per-tenant accounting on the engine thread: tokens in and out, KV block-seconds, and
    finished requests by reason. Read from other threads (plain ints and floats)."""

    def __init__(self) -> None:
        self.prompt_tokens: Counter[str] = Counter()
        self.generation_tokens: Counter[str] = Counter()
        self.block_seconds: dict[str, float] = {}
        self.finished: Counter[tuple[str, str]] = Counter()  # (tenant, finish reason)

    def record(self, stats: IterationStats, tenant_blocks: dict[str, int]) -> None:
        self.prompt_tokens.update(stats.prompt_tokens_by_tenant)
        self.generation_tokens.update(stats.generation_tokens_by_tenant)
        if stats.inside_step:  # the enclosing step counts this wall time for every block
            tenant_blocks = {}
        for tenant, blocks in tenant_blocks.items():
            held = self.block_seconds.get(tenant, 0.0)
            self.block_seconds[tenant] = held + blocks * stats.step_seconds
        for f in stats.finished:
            self.finished[(f.tenant, f.finish_reason)] += 1


class StatsListener(Protocol):
    def on_step(self, stats: IterationStats) -> None:
        """Called on the engine thread after each step; must be quick and never raise."""
        ...
