"""Perplexity of an engine's model on a token sequence, in windows that each start fresh."""

from __future__ import annotations

import math

import torch

from kvgate.engine.llm_engine import LLMEngine
from kvgate.model.row_roles import RowRoles
from tests.model.steps import one_prefill


def perplexity(engine: LLMEngine, ids: list[int], window: int, as_prompt: bool = True) -> float:
    """exp(mean NLL) of every token after the first of each window, one prefill per window
    (written to the engine's KV caches from slot 0), each token as a prompt token, or with
    ``as_prompt=False`` through the products generated tokens take (where the two differ:
    ``Model.prompt_tiles``)."""
    model, (caches, bs) = engine.model, (engine.runner.kv_caches, engine.config.block_size)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        tokens = torch.tensor(ids[start : start + window])
        n = len(tokens)
        meta = one_prefill(n, bs)
        # every token is a prompt token (where that chooses the linears, as served)
        roles = RowRoles.of([True] * n) if model.prompt_tiles and as_prompt else None
        hidden = model.forward(tokens, torch.arange(n), caches, meta, roles)
        logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]).float(), dim=-1)
        nll -= logprobs.gather(1, tokens[1:, None]).sum().item()
        count += n - 1
    return math.exp(nll / count)
