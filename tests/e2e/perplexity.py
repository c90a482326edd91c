"""Perplexity of an engine's model on a token sequence, in windows that each start fresh."""

from __future__ import annotations

import math

import torch

from kvgate.engine.llm_engine import LLMEngine
from kvgate.model.attention import AttentionMetadata, PrefillSlice


def perplexity(engine: LLMEngine, ids: list[int], window: int) -> float:
    """exp(mean NLL) of every token after the first of each window, one prefill per window
    (written to the engine's KV caches from slot 0)."""
    model, (caches, bs) = engine.model, (engine.runner.kv_caches, engine.config.block_size)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        tokens = torch.tensor(ids[start : start + window])
        n = len(tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n),
            num_decodes=0,
            decode_blocks=torch.empty(0, dtype=torch.long),
            decode_lens=torch.empty(0, dtype=torch.long),
            prefills=(PrefillSlice(0, n, 0, torch.arange(-(-n // bs))),),
        )
        hidden = model.forward(tokens, torch.arange(n), caches, meta)
        logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]).float(), dim=-1)
        nll -= logprobs.gather(1, tokens[1:, None]).sum().item()
        count += n - 1
    return math.exp(nll / count)
