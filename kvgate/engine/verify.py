"""Speculative drafts checked against the model: the draft tokens it would have produced.

A draft of ``k`` tokens after a request's known token gives ``k + 1`` rows of logits: row
``j`` is the model's distribution for the token after the known one and draft tokens
``0 .. j - 1``. The verifier samples row ``j`` exactly as a plain decode step would sample
that position (same logits, same penalties over the tokens before it, same grammar state,
same seeded generator) and keeps draft token ``j`` while the sample equals it; the first
sample that differs, or the one after a fully accepted draft, is the step's new token.

So greedy output is token for token what decoding without drafts gives (the rows' logits
are computed as decodes are: ``ModelRunner.build_batch``), and a random row draws its
token from the model's own distribution: for a draft that proposes one token with
certainty, "accept when the sample equals it" accepts with probability p(token) and
otherwise yields a sample of p without that token, which is the speculative-sampling rule
(Leviathan et al. 2023) for such a draft. A seeded request consumes its generator exactly
as plain decoding would (one row at a time, stopping at the first difference), so it gets
the very same tokens; a constrained one advances its grammar one accepted token at a time,
and a draft token the grammar refuses is simply never sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import llguidance
import torch

from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.sampler import Sampler, SamplingState
from kvgate.sampling_params import SamplingParams
from kvgate.structured.masks import MaskBuilder


@dataclass
class Drafted:
    """One speculating request of the step: where its rows are in the step's logits, and
    the runner's state it samples with (changed in place: output tokens, grammar)."""

    request_id: str
    draft: tuple[int, ...]
    first_row: int  # rows first_row .. first_row + len(draft)
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    matcher: llguidance.LLMatcher | None = None


@dataclass
class Verified:
    """What one request got: the accepted draft tokens, then the new token."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    complete: bool = False
    failed: str | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


class DraftVerifier:
    """``masks``: the step's mask builder (constrained requests only)."""

    def __init__(self, sampler: Sampler, masks: Callable[[], MaskBuilder]) -> None:
        self.sampler = sampler
        self.masks = masks

    def __call__(self, logits: torch.Tensor, drafted: Sequence[Drafted]) -> dict[str, Verified]:
        """``logits`` [rows, vocab]: the step's sampled rows. Appends each request's new
        tokens to its ``output_token_ids`` (and its grammar)."""
        out: dict[str, Verified] = {}
        together = [d for d in drafted if d.generator is None and d.matcher is None]
        if together:
            out.update(self._together(logits, together))
        for d in drafted:
            if d.generator is not None or d.matcher is not None:
                out[d.request_id] = self._one_by_one(logits, d)
        return out

    def _together(self, logits: torch.Tensor, drafted: Sequence[Drafted]) -> dict[str, Verified]:
        """Requests whose rows depend on nothing drawn before them (no seed, no grammar):
        every row of every draft sampled in one call, then compared."""
        rows: list[int] = []
        states: list[SamplingState] = []
        for d in drafted:
            for j in range(len(d.draft) + 1):
                rows.append(d.first_row + j)
                states.append(self._state(d, j))
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        result = self.sampler(logits.index_select(0, index), states)
        out: dict[str, Verified] = {}
        at = 0
        for d in drafted:
            got = Verified()
            for j in range(len(d.draft) + 1):
                token = result.token_ids[at + j]
                got.tokens.append(token)
                got.logprobs.append(result.logprobs[at + j])
                if j == len(d.draft) or token != d.draft[j]:
                    break
            at += len(d.draft) + 1
            d.output_token_ids.extend(got.tokens)
            out[d.request_id] = got
        return out

    def _one_by_one(self, logits: torch.Tensor, d: Drafted) -> Verified:
        """A seeded or constrained request: row by row, each after the last one's token
        (its generator and grammar advance exactly as in plain decoding)."""
        got = Verified()
        for j in range(len(d.draft) + 1):
            row = logits[d.first_row + j : d.first_row + j + 1]
            allowed = None
            if d.matcher is not None:
                allowed = ([0], self.masks().start([d.matcher]).result())
            result = self.sampler(row, [self._state(d, 0)], allowed)
            token = result.token_ids[0]
            got.tokens.append(token)
            got.logprobs.append(result.logprobs[0])
            d.output_token_ids.append(token)
            if d.matcher is not None:
                d.matcher.consume_token(token)
                if d.matcher.is_error():  # never expected under the mask
                    got.failed = d.matcher.get_error()
                    break
                if d.matcher.is_stopped():  # complete: nothing may follow
                    got.complete = True
                    break
            if j == len(d.draft) or token != d.draft[j]:
                break
        return got

    @staticmethod
    def _state(d: Drafted, j: int) -> SamplingState:
        """The sampling state of row ``j``: as if draft tokens ``0 .. j - 1`` were output."""
        outputs: Sequence[int] = d.output_token_ids
        if j:
            outputs = [*d.output_token_ids, *d.draft[:j]]
        return SamplingState(d.params, d.generator, d.prompt_token_ids, outputs)
