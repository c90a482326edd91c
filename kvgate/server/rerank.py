"""Rerank by the served LLM (``file_search`` with ``ranking_options: {ranker:
"kvgate-llm"}``): each retrieved passage is put to the model with the question, and asked
whether it answers it; the passages are reordered by how much more likely the model's first
token is ``Yes`` than ``No`` (its log-probabilities: one prefill and one token per passage,
all passages one batch). Ties keep the retriever's order.

The passages run as the caller's own requests, through the same admission as any other:
the tenant's token budgets, KV quota and queue share apply, and its usage is recorded.
Its effect on recall is not measured yet (bench/longdoc.py measures the retriever alone);
a model as small as the shipped ones is expected to judge Chinese passages poorly, which is
why it is off unless asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fastapi import Request

from kvgate.docs.service import SearchResult
from kvgate.server.chat import chat_prompt_ids
from kvgate.server.choices import admit_choices
from kvgate.server.constraints import Constraints
from kvgate.server.door import off_loop
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.respond import run_merged
from kvgate.server.serving import ServingContext
from kvgate.server.tracing import CHAT

RANKER = "kvgate-llm"
#: At most this many passages are judged (the rest keep their places after them), each cut
#: to this many characters.
MAX_PASSAGES = 10
MAX_PASSAGE_CHARS = 1200
TOP_LOGPROBS = 20

_ASK = (
    "Question: {question}\n\nPassage:\n{passage}\n\n"
    "Does the passage answer the question? Answer Yes or No."
)


def _first_ids(ctx: ServingContext, words: Sequence[str]) -> set[int]:
    ids = set()
    for w in words:
        encoded = ctx.tokenizer.encode(w, add_special_tokens=False)
        if encoded:
            ids.add(encoded[0])
    return ids


def _judgement(top: Sequence[tuple[int, float]], yes: set[int], no: set[int]) -> float:
    """log P(yes) - log P(no) over the top alternatives; a side absent from them counts at
    the least likely alternative's log-probability (an upper bound)."""
    if not top:
        return 0.0
    floor = min(lp for _, lp in top)

    def mass(ids: set[int]) -> float:
        ps = [math.exp(lp) for t, lp in top if t in ids]
        return math.log(sum(ps)) if ps else floor

    return mass(yes) - mass(no)


async def rerank(
    ctx: ServingContext,
    http: Request,
    results: list[SearchResult],
    question: str,
    response_id: str,
) -> list[SearchResult]:
    """``results`` reordered by the model's judgement (see the module)."""
    head, tail = results[:MAX_PASSAGES], results[MAX_PASSAGES:]
    if len(head) < 2:
        return results
    prompts = []
    for r in head:
        ask = _ASK.format(question=question, passage=r.text[:MAX_PASSAGE_CHARS])
        chat = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": ask}], "max_tokens": 1}, strict=False
        )
        prompts.append(await off_loop(chat_prompt_ids, ctx, chat, Constraints()))
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": question}], "max_tokens": 1,
         "temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS},
        strict=False,
    )  # fmt: skip
    requests, tracker = admit_choices(
        ctx, http, prompts, body, max_tokens=1, logprobs=TOP_LOGPROBS, operation=CHAT,
        response_id=f"{response_id}-rerank",
    )  # fmt: skip
    yes = _first_ids(ctx, ("Yes", " Yes", "yes", " yes", "YES"))
    no = _first_ids(ctx, ("No", " No", "no", " no", "NO"))
    scores = [0.0] * len(head)
    try:
        async for i, out in run_merged(ctx.engine, requests):
            tracker.on_output(i, out)
            if out.logprobs:
                scores[i] = _judgement(out.logprobs[0].top_logprobs, yes, no)
        await tracker.settle_whole()
    finally:
        tracker.close()
    order = sorted(range(len(head)), key=lambda i: (-scores[i], i))
    return [head[i] for i in order] + tail
