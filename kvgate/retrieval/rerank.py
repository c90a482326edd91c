"""Reranking passages by a language model's judgement, the parts that need no server: the
question put to the model, the tokens that mean yes and no, and the score read from the
log-probabilities of its first token (server/rerank.py runs it as a tenant's requests;
bench/longdoc.py --rerank measures it offline)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

#: At most this many passages are judged (the rest keep their places after them), each cut
#: to this many characters; the alternatives read from the model's first token.
MAX_PASSAGES = 10
MAX_PASSAGE_CHARS = 1200
TOP_LOGPROBS = 20

_ASK = (
    "Question: {question}\n\nPassage:\n{passage}\n\n"
    "Does the passage answer the question? Answer Yes or No."
)


def question_for(question: str, passage: str, max_chars: int | None = MAX_PASSAGE_CHARS) -> str:
    """The user turn that asks the model about one passage, cut to ``max_chars`` (None: the
    whole passage)."""
    return _ASK.format(question=question, passage=passage[:max_chars])


def relevance(log_odds: float) -> float:
    """The log-odds of yes against no as a probability in (0, 1): the logistic sigmoid,
    ``P(yes) / (P(yes) + P(no))`` with the two renormalised (what Qwen3-Reranker's card
    computes from the same two tokens). It rounds to 0.0 or 1.0 in float64 beyond about
    -745 and +37; the order is the log-odds', never lost to the rounding."""
    if log_odds >= 0:
        return 1.0 / (1.0 + math.exp(-log_odds))
    z = math.exp(log_odds)
    return z / (1.0 + z)


def answer_ids(encode: Callable[[str], list[int]]) -> tuple[set[int], set[int]]:
    """The first token ids of the ways the model may write yes, and no."""

    def first(words: Sequence[str]) -> set[int]:
        return {ids[0] for w in words if (ids := encode(w))}

    return first(("Yes", " Yes", "yes", " yes", "YES")), first(("No", " No", "no", " no", "NO"))


def judgement(top: Sequence[tuple[int, float]], yes: set[int], no: set[int]) -> float:
    """log P(yes) - log P(no) over the top alternatives; a side absent from them counts at
    the least likely alternative's log-probability (an upper bound)."""
    if not top:
        return 0.0
    floor = min(lp for _, lp in top)

    def mass(ids: set[int]) -> float:
        ps = [math.exp(lp) for t, lp in top if t in ids]
        return math.log(sum(ps)) if ps else floor

    return mass(yes) - mass(no)


def reorder(scores: Sequence[float]) -> list[int]:
    """Indices by score, best first; ties keep the retriever's order."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))
