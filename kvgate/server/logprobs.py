"""Logprobs in the two OpenAI layouts: chat's ``content`` list and completions' columns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgate.engine.messages import TokenLogprobs
from kvgate.tokenizer import Tokenizer


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
