"""Draft tokens for speculative decoding, looked up in the request's own tokens.

Prompt lookup (vLLM's ``ngram`` method, llama.cpp's lookup decoding): the last ``n`` tokens
of a request (``n`` from ``ngram_max`` down to ``ngram_min``, the longest that matches wins)
are searched for earlier in its prompt and output; the ``k`` tokens that followed the latest
earlier occurrence are the draft. An answer that quotes its sources copies whole clauses
from the prompt, and the model then confirms several tokens in one forward pass.

Pure Python and numpy, no tensors: the scheduler asks for drafts while it plans a step, and
tells the drafter how many tokens of each draft the model accepted. A request whose drafts
are mostly refused stops drafting for a while (``SpeculativeConfig.pause_steps``, doubling
each time it happens again), so text with no copying costs almost nothing.

Verifying is not free everywhere: a draft's rows cost what the CPU's kernels charge for
more rows. An AMX tile multiplies 16 rows for the price of one; on an AVX2 Zen 2 the
K-quant kernels are already compute-bound at 2 rows (Qwen 1.5B shapes, ``bench/qlinears.py``:
2 rows cost 1.4x one row, 5 rows 3.4x), so 4 draft tokens that the model mostly accepts
still made the step slower than the tokens they saved. So the drafter keeps the measured
time of decode steps by rows (``StepCosts``) and verifies only as many draft tokens as
raise the step's expected tokens per second, from each request's own acceptance so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvgate.config import SpeculativeConfig
from kvgate.engine.request import Request


def lookup(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` ([L] int64) of ``ngram_min``..``ngram_max`` tokens; [] when none recurs.

    One vectorized pass over the tokens per n-gram size tried: candidates are the ends ``e``
    (the continuation's first index, ``e < L``) where the last suffix token occurs, narrowed by
    each earlier suffix token in turn."""
    size = len(tokens)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = tokens[size - n :]
        ends = np.flatnonzero(tokens[n - 1 : size - 1] == suffix[-1]) + n
        for back in range(2, n + 1):
            if not ends.size:
                break
            ends = ends[tokens[ends - back] == suffix[-back]]
        if ends.size:
            e = int(ends[-1])
            return [int(t) for t in tokens[e : e + k]]
    return []


class StepCosts:
    """Seconds of a decode-only step by its rows (an exponential moving average each),
    observed on the engine thread after every such step."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + self.weight * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        """Seconds of a step of ``rows`` rows: measured, or interpolated between the nearest
        sizes measured on either side; None beyond what was measured."""
        known = self._seconds
        if rows in known:
            return known[rows]
        below = max((r for r in known if r < rows), default=None)
        above = min((r for r in known if r > rows), default=None)
        if below is None or above is None:
            return None
        share = (rows - below) / (above - below)
        return known[below] + share * (known[above] - known[below])


@dataclass
class _DraftState:
    """One request's tokens as an array (grown in place) and its recent acceptance."""

    buf: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    size: int = 0
    #: (drafted, accepted) of its last ``window`` drafts.
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    #: Decode steps left without drafts, and the length of the next pause.
    paused: int = 0
    next_pause: int = 0
    #: Over the request's life: draft tokens verified, and accepted.
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """The chance a draft token is accepted, with one accepted and one refused assumed
        before any was verified."""
        return (self.accepted + 1) / (self.drafted + 2)

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The request's tokens as [L] int64, copying only those new since the last call."""
        n = len(token_ids)
        if n < self.size:  # never expected (tokens only grow): start over
            self.size = 0
        if n > len(self.buf):
            grown = np.empty(max(n, 2 * len(self.buf)), dtype=np.int64)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if n > self.size:
            self.buf[self.size : n] = token_ids[self.size : n]
            self.size = n
        return self.buf[:n]


class NgramDrafter:
    """Drafts for the requests that speculate; per-request state lives until ``forget``."""

    #: One cost decision in this many verifies a token more than the best (``worth``).
    EXPLORE_EVERY = 32

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._states: dict[str, _DraftState] = {}
        #: Totals since start: drafts proposed, their tokens, the tokens accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.costs = StepCosts()
        self._decisions = 0

    def wants(self, request: Request) -> bool:
        """Whether ``request`` speculates at all (it may opt out per request)."""
        return request.params.speculative is not False

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """At most ``min(max_tokens, num_tokens)`` draft tokens to follow ``request``'s known
        tokens; [] when nothing recurs or the request is paused."""
        k = min(max_tokens, self.config.num_tokens)
        if k <= 0 or not self.wants(request):
            return []
        state = self._states.setdefault(request.request_id, _DraftState())
        if state.paused > 0:
            state.paused -= 1
            return []
        cfg = self.config
        return lookup(state.sync(request.all_token_ids), k, cfg.ngram_min, cfg.ngram_max)

    def worth(self, request_id: str, draft_len: int, rows: int, tokens: float) -> int:
        """How many of a ``draft_len``-token draft to verify in a step that already has
        ``rows`` decode rows and is expected to yield ``tokens`` tokens: the length with the
        most expected tokens per second of the step (``StepCosts``).

        Costs are learnt from the steps that run: with the plain step's cost unknown, none
        (so it gets measured); a longer step never measured is tried once; and one decision
        in ``EXPLORE_EVERY`` tries one token more than the best, so a size judged on a slow
        first measurement (a cold cache, a busy machine) is measured again."""
        if draft_len <= 0:
            return 0
        now = self.costs.estimate(rows)
        if now is None or now <= 0:
            return 0
        state = self._states.get(request_id)
        alpha = state.acceptance if state is not None else 0.5
        best, best_rate = 0, tokens / now
        gain = 0.0
        for d in range(1, draft_len + 1):
            gain += alpha**d  # expected accepted tokens of a d-token draft
            seconds = self.costs.estimate(rows + d)
            if seconds is None:
                return d
            rate = (tokens + gain) / seconds
            if rate > best_rate:
                best, best_rate = d, rate
        self._decisions += 1
        if best < draft_len and self._decisions % self.EXPLORE_EVERY == 0:
            return best + 1
        return best

    def expected(self, request_id: str, draft_len: int) -> float:
        """Expected accepted tokens of a ``draft_len``-token draft of the request."""
        state = self._states.get(request_id)
        alpha = state.acceptance if state is not None else 0.5
        return sum(alpha**d for d in range(1, draft_len + 1))

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """The model accepted ``accepted`` of a draft of ``drafted`` tokens."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        state = self._states.get(request_id)
        if state is None:
            return
        cfg = self.config
        state.drafted += drafted
        state.accepted += accepted
        state.recent.append((drafted, accepted))
        if len(state.recent) < cfg.window:
            return
        total = sum(d for d, _ in state.recent)
        rate = sum(a for _, a in state.recent) / total if total else 0.0
        state.recent.clear()
        if rate < cfg.min_acceptance:
            state.paused = state.next_pause or cfg.pause_steps
            state.next_pause = min(2 * state.paused, cfg.max_pause_steps)
        else:
            state.next_pause = 0

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
