"""Rerank by the served LLM (``file_search`` with ``ranking_options: {ranker:
"kvgate-llm"}``): each retrieved passage is put to the model with the question, and asked
whether it answers it; the passages are reordered by how much more likely the model's first
token is ``Yes`` than ``No`` (its log-probabilities: one prefill and one token per passage,
all passages one batch). Ties keep the retriever's order.

The passages run as the caller's own requests, through the same admission as any other:
the tenant's token budgets, KV quota and queue share apply, and its usage is recorded.
Its effect on recall: ``bench/longdoc.py --rerank MODEL`` (figures in bench/results/).
"""

from __future__ import annotations

from fastapi import Request

from kvgate.retrieval.rerank import (
    MAX_PASSAGES,
    TOP_LOGPROBS,
    answer_ids,
    judgement,
    question_for,
    reorder,
)
from kvgate.retrieval.service import SearchResult
from kvgate.server.chat import chat_prompt_ids
from kvgate.server.choices import admit_choices
from kvgate.server.constraints import Constraints
from kvgate.server.door import off_loop
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.respond import run_merged
from kvgate.server.serving import ServingContext
from kvgate.server.tracing import CHAT

RANKER = "kvgate-llm"


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
        ask = question_for(question, r.text)
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
    yes, no = answer_ids(lambda w: ctx.tokenizer.encode(w, add_special_tokens=False))
    scores = [0.0] * len(head)
    try:
        async for i, out in run_merged(ctx.engine, requests):
            tracker.on_output(i, out)
            if out.logprobs:
                scores[i] = judgement(out.logprobs[0].top_logprobs, yes, no)
        await tracker.settle_whole()
    finally:
        tracker.close()
    return [head[i] for i in reorder(scores)] + tail
