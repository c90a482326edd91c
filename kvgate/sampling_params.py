"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.errors import InvalidSamplingParams
from kvgate.structured.spec import Grammar

#: Most top logprobs a request may ask for (OpenAI caps top_logprobs at 20).
MAX_LOGPROBS = 20


def _tuple_of_str(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``seed`` makes a request reproducible whatever else shares its batch.
    ``logprobs`` is ``None`` for none, ``0`` for the chosen token only, ``k`` for it plus the top k.
    ``grammar``: each token is sampled among those the grammar allows next; the request
    ends ("stop") when the grammar is complete and nothing may follow.
    ``final_only``: the engine reports the request once, when it ends (every token, the whole
    text and logprobs in that one output), not a delta after every step. A response that is
    not streamed needs nothing more, and a server then wakes its event loop once per request
    instead of once per token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    final_only: bool = False
    #: What the output must match (response_format, tools); None: unconstrained.
    grammar: Grammar | None = None
    #: Speculative decoding for this request (``engine/drafter.py``): None follows the
    #: server (on where it was started with ``--speculative``), False opts out, True asks
    #: for it (refused where the server has none).
    speculative: bool | None = None
    #: The LoRA adapter to run the request with, by its registered name
    #: (``engine/lora_cache.py``); None: the base model alone.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        # Accept a bare string or a list for stop, as the OpenAI API does.
        object.__setattr__(self, "stop", _tuple_of_str(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: looked up after every token."""
        return frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidSamplingParams:
            value = getattr(self, param)
            return InvalidSamplingParams(f"{param} {why}, got {value!r}", param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "must be an integer")
        if self.max_tokens <= 0:
            raise bad("max_tokens", "must be at least 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
