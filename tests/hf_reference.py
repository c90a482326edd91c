"""HF transformers as the reference: greedy continuations, one prompt at a time (no padding)."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Token ids HF ``generate`` appends to each prompt, greedy, stopping at EOS (id 2)."""
    model.eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=2,
                eos_token_id=2,
            )
        outs.append(gen[0, len(p) :].tolist())
    return outs
