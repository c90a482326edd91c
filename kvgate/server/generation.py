"""What chat and completions share: sampling parameters from a body, n choices run together,
and logprobs in the two OpenAI layouts.

A request's choices are built (tokenized, validated, sized) before anything is sent, so a bad
request is refused with a clear error before a stream begins; they then run as separate
engine requests whose deltas are merged in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.errors import InvalidRequest, PromptTooLong
from kvgate.sampling_params import SamplingParams
from kvgate.server.errors import ModelNotServed
from kvgate.server.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServingContext:
    engine: AsyncLLM
    served_model_name: str
    #: Makes engine request ids unique even when clients reuse an x-request-id.
    ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        """A body naming another model is a 404, as with OpenAI; no name means ours."""
        if model is not None and model != self.served_model_name:
            raise ModelNotServed(model, self.served_model_name)


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    logprobs: int | None,
    seed: int | None,
) -> SamplingParams:
    """SamplingParams from the body's fields; OpenAI's defaults where a field is absent."""
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        seed=seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        logprobs=logprobs,
        skip_special_tokens=True if body.skip_special_tokens is None else body.skip_special_tokens,
    )


def build_choices(
    ctx: ServingContext,
    request_id: str,
    prompts: Sequence[list[int]],
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
) -> list[Request]:
    """One engine request per (prompt, choice), choice index = prompt_index * n + j.

    With a seed, choice j samples with ``seed + j``: reproducible, yet the n choices differ.
    Without ``max_tokens`` a choice may run to the end of the context, as OpenAI's API does.
    """
    n = body.n or 1
    requests: list[Request] = []
    for p, prompt in enumerate(prompts):
        if not prompt:
            raise InvalidRequest("prompt must contain at least one token", param="prompt")
        room = ctx.max_model_len - len(prompt)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise PromptTooLong(len(prompt), max_tokens or 1, ctx.max_model_len)
        for j in range(n):
            params = sampling_params(
                body,
                max_tokens=max_tokens,
                default_max_tokens=room,
                logprobs=logprobs,
                seed=None if body.seed is None else body.seed + j,
            )
            engine_id = f"{request_id}-{p * n + j}-{next(ctx.ids)}"
            requests.append(ctx.engine.engine.make_request(engine_id, prompt, params))
    return requests


async def run_merged(
    engine: AsyncLLM, requests: Sequence[Request]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of all ``requests`` as (choice index, delta), each choice's in order.

    Leaving early (a disconnect cancels the consumer) aborts every choice still running.
    """
    if len(requests) == 1:
        async for out in engine.stream(requests[0]):
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: Request) -> None:
        try:
            async for out in engine.stream(request):
                await merged.put((index, out))
        except Exception as exc:
            await merged.put((index, exc))
        else:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # runs each stream's cleanup: its request is aborted in the engine
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ------------------------------------------------------------------ logprobs layouts


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(raw),
    }


def chat_logprobs(tokenizer: Tokenizer, items: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` of the chat API."""
    return [
        {
            **_token_entry(tokenizer, lp.token_id, lp.logprob),
            "top_logprobs": [_token_entry(tokenizer, t, v) for t, v in lp.top_logprobs],
        }
        for lp in items
    ]


def completion_logprobs(
    tokenizer: Tokenizer, items: Sequence[TokenLogprobs], text_offset: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of the legacy completions API; offsets count characters."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in items:
        text = tokenizer.token_bytes(lp.token_id).decode("utf-8", errors="replace")
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top_logprobs:
            top.setdefault(tokenizer.token_bytes(t).decode("utf-8", errors="replace"), v)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
