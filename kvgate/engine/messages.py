"""Frozen messages between the scheduler (pure Python) and the model runner (tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.request import Request
from kvgate.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled: what the runner keeps per request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    #: The request's grammar matcher (constrained requests), built off the engine thread
    #: when the request was made: the runner takes it over (never compiles in a step).
    matcher: Any = None
    #: The request's LoRA adapter (``model.lora.LoraAdapter``; None: the base model).
    lora: Any = None


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step: compute ``token_ids`` at positions from ``start_pos``.

    ``tables`` are the request's block tables after allocation, one per KV group
    (``KVLayout``), -1 where a sliding group gave a block back. ``sample`` is True when this
    step reaches the end of the known tokens, so its last logits give the next token; a
    prefill chunk that stops short of the end samples nothing.

    ``num_draft``: the last ``num_draft`` of ``token_ids`` are a speculative draft
    (``engine/drafter.py``) after the request's one known token: every row is sampled, and
    the runner keeps the draft tokens the model would have produced itself.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    tables: tuple[tuple[int, ...], ...]
    sample: bool
    num_draft: int = 0

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The first group's table (the only one of a model without sliding layers)."""
        return self.tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft :]

    @property
    def is_decode(self) -> bool:
        """One known token (and maybe a draft): each row attends as a decode would."""
        return self.num_tokens - self.num_draft == 1

    @property
    def context_len(self) -> int:
        """Tokens of KV this sequence attends to once the step's tokens are written."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    sequences: tuple[ScheduledSequence, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    #: Requests that ended since the last step; the runner drops their per-request state.
    finished_request_ids: frozenset[str] = field(default_factory=frozenset)
    #: Requests pushed back to waiting (recompute) during this schedule.
    preempted_request_ids: tuple[str, ...] = ()
    #: Requests this schedule ended because they can never run (e.g. over their tenant's
    #: KV ceiling with nothing to wait for); the engine reports them, the runner never
    #: saw them.
    refused: tuple[Request, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and of the top-k alternatives (raw logits)."""

    token_id: int
    logprob: float
    #: The ``params.logprobs`` most likely tokens, most likely first.
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced: a new token for every sequence that sampled, after the
    draft tokens the model accepted (speculating sequences)."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    #: Draft tokens accepted before the sampled token (a prefix of the draft; absent: none).
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Their logprobs, where the request asked for logprobs.
    accepted_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    #: Constrained requests whose grammar is complete with their new token (nothing may
    #: follow): they end, finish reason "stop".
    grammar_complete: frozenset[str] = field(default_factory=frozenset)
    #: Constrained requests whose grammar could not go on (a dead end, or a token it did not
    #: allow): they end with an error, never claiming valid output. Id -> the reason.
    grammar_failed: dict[str, str] = field(default_factory=dict)

    def new_tokens(self, request_id: str) -> tuple[int, ...]:
        """Every token ``request_id`` got in this step, in order (none: it sampled nothing)."""
        token = self.sampled_token_ids.get(request_id)
        if token is None:
            return ()
        return (*self.accepted.get(request_id, ()), token)
