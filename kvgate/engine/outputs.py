"""What the engine hands back to callers, one delta per request per step."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.stats import RequestMetrics


@dataclass(frozen=True)
class RequestOutput:
    """New tokens and text of one request since its previous output.

    ``text`` is safe to show: it never ends inside a multi-byte character or inside a
    possible stop string. The last output of a request has ``finished=True``.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    #: The request's timeline; on the final output only.
    metrics: RequestMetrics | None = None
    tenant: str = "default"


@dataclass(frozen=True)
class CompletionOutput:
    """A whole generation, as the offline ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
