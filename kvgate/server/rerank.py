"""Rerank by the served LLM: each passage is put to the model with the question, and asked
whether it answers it; a passage's score is how much more likely the model's first token is
``Yes`` than ``No`` (its log-probabilities: one prefill and one token per passage, all
passages one batch). ``judge`` scores; two callers order by it: ``file_search`` with
``ranking_options: {ranker: "kvgate-llm"}`` (``rerank``; ties keep the retriever's order) and
``POST /v1/rerank`` (``rerank_endpoint.py``).

The passages run as the caller's own requests, through the same admission as any other:
the tenant's token budgets, KV quota and queue share apply, and its usage is recorded.
Its effect on recall: ``bench/longdoc.py --rerank MODEL`` (figures in bench/results/).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import Request

from kvgate.retrieval.rerank import (
    MAX_PASSAGE_CHARS,
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


@dataclass(frozen=True)
class Judged:
    """Each passage's log-odds of yes against no, in the passages' order, and the tokens
    its requests used (what the tenant is billed)."""

    scores: list[float]
    prompt_tokens: int
    completion_tokens: int


def judge_prompts(
    ctx: ServingContext,
    question: str,
    passages: Sequence[str],
    max_chars: int | None = MAX_PASSAGE_CHARS,
) -> list[list[int]]:
    """Each passage's prompt, templated and tokenized (a worker thread's work: ``off_loop``);
    passages cut to ``max_chars`` (None: whole)."""
    prompts = []
    for passage in passages:
        ask = question_for(question, passage, max_chars)
        chat = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": ask}], "max_tokens": 1}, strict=False
        )
        prompts.append(chat_prompt_ids(ctx, chat, Constraints()))
    return prompts


async def judge(
    ctx: ServingContext,
    http: Request,
    question: str,
    prompts: Sequence[list[int]],
    response_id: str,
) -> Judged:
    """Run ``prompts`` (``judge_prompts``) as the caller's requests, one token each, and read
    each one's judgement; cancelled, it aborts them."""
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": question}], "max_tokens": 1,
         "temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS},
        strict=False,
    )  # fmt: skip
    requests, tracker = admit_choices(
        ctx, http, prompts, body, max_tokens=1, logprobs=TOP_LOGPROBS, operation=CHAT,
        response_id=response_id,
    )  # fmt: skip
    yes, no = answer_ids(lambda w: ctx.tokenizer.encode(w, add_special_tokens=False))
    scores = [0.0] * len(prompts)

    try:
        async for i, out in run_merged(ctx.engine, requests):
            tracker.on_output(i, out)
            if out.logprobs:
                scores[i] = judgement(out.logprobs[0].top_logprobs, yes, no)
        await tracker.settle_whole()
    finally:
        tracker.close()
    counts = tracker.counts()
    return Judged(scores, counts.prompt_tokens, counts.completion_tokens)


async def rerank(
    ctx: ServingContext,
    http: Request,
    results: list[SearchResult],
    question: str,
    response_id: str,
) -> list[SearchResult]:
    """``results`` reordered by the model's judgement (see the module): the first
    ``MAX_PASSAGES``, each cut to ``MAX_PASSAGE_CHARS``; the rest keep their places after
    them."""
    head, tail = results[:MAX_PASSAGES], results[MAX_PASSAGES:]
    if len(head) < 2:
        return results
    prompts = await off_loop(judge_prompts, ctx, question, [r.text for r in head])
    judged = await judge(ctx, http, question, prompts, f"{response_id}-rerank")
    return [head[i] for i in reorder(judged.scores)] + tail
