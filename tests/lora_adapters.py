"""Tiny LoRA adapters made with peft for the tests of kvgate/model/lora.py and the engine."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

#: Every projection a Llama-family layer has (PEFT's module names).
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Any, directory: Path, seed: int, **settings: Any) -> Any:
    """A peft model over a copy of the transformers model ``base`` with random non-zero A and
    B (``init_lora_weights=False``: a test can fail), saved in ``directory``; returned for
    reference generations. ``settings``: ``LoraConfig`` fields (default r=8, alpha=16, every
    projection)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ALL, **settings}
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    model.eval().save_pretrained(directory)
    return model
