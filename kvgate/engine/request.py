"""One generation request as the scheduler sees it: tokens known, tokens computed, blocks held."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

from kvgate.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    #: Ran past its deadline: ends with the output so far.
    FINISHED_DEADLINE = "deadline"
    #: Waited in the queue past its tenant's maximum queue time: refused, nothing generated.
    FINISHED_QUEUE_TIMEOUT = "queue_timeout"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return self.value if self.finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
        RequestStatus.FINISHED_DEADLINE,
        RequestStatus.FINISHED_QUEUE_TIMEOUT,
    }
)


class Request:
    """Mutable per-request state owned by the scheduler.

    The one scheduling rule: ``num_computed_tokens`` catches up with ``num_tokens``. A fresh
    prompt, a chunked prefill, a prefix-cache hit and a decode step are all that rule.
    ``block_hashes[i]`` is the hash-chain key of the i-th *full* block of ``all_token_ids``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: bytes | None = None,
        arrival_time: float | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        queue_deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        #: Whose request this is: the scheduling policy's quotas, shares and priority key.
        self.tenant = tenant
        #: time.monotonic() after which the request ends with what it has ("deadline").
        self.deadline = deadline
        #: time.monotonic() after which a request never scheduled is refused ("queue_timeout").
        self.queue_deadline = queue_deadline
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        #: The grammar's matcher (constrained requests), compiled when the request was made;
        #: handed to the runner with the request's first schedule, which then owns it.
        self.matcher: Any = None
        #: The request's LoRA adapter (a ``model.lora.LoraAdapter``), taken from the engine's
        #: adapters when the request is added (``params.lora_name``); handed to the runner.
        self.lora: Any = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        #: Prompt tokens served from the prefix cache the first time this request was scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        #: Its prefix was loaded from the second KV tier since it was last admitted (or the
        #: load failed): the next admission recomputes what the pool lost meanwhile.
        self.tier_tried = False
        #: Most KV blocks the request held at once (its memory footprint, for the profile).
        self.peak_kv_blocks = 0
        #: KV blocks held times seconds, summed over the steps it held them (usage records).
        self.kv_block_seconds = 0.0
        #: (time.monotonic(), tokens) of each prompt chunk scheduled, for traces.
        self.prefill_chunks: list[tuple[float, int]] = []
        #: The stop string or stop token id that ended the request, if any.
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        # Timeline (time.monotonic seconds) for latency metrics and the per-request profile.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` output tokens (a stop string ended the
        request inside a step's accepted draft: the tokens after it were never produced)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop rules (EOS, stop ids, max_tokens, context end) after a new token.

        Stop *strings* need the detokenizer and are checked by the output processor.
        """
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in self.params.stop_token_set:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
