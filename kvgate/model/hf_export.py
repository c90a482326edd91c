"""Write a loaded checkpoint as a plain Hugging Face directory (config.json + safetensors).

Converts the packaged GGUF once into the layout Llama checkpoints arrive in, so that other
tools (transformers, the benchmarks' peers) can read exactly the weights kvgate serves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvgate.model.checkpoint import Checkpoint


def hf_config(checkpoint: Checkpoint, dtype: torch.dtype) -> dict[str, Any]:
    c = checkpoint.config
    config: dict[str, Any] = {
        "architectures": [c.arch.hf_class],
        "model_type": c.arch.hf_model_types[0],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,  # Qwen2's biases are its own; elsewhere o_proj's too
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids)
        if len(c.eos_token_ids) > 1
        else (c.eos_token_ids[0] if c.eos_token_ids else None),
    }
    config = c.arch.export_hf(c, config)  # its own fields (Gemma 3's windows)
    if c.rope_scaling is not None:
        s = c.rope_scaling
        config["rope_scaling"] = {
            "rope_type": s.kind,
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
        if s.kind == "llama3":
            config["rope_scaling"].update(
                low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor
            )
        elif s.kind == "yarn":
            config["rope_scaling"].update(
                beta_fast=s.beta_fast,
                beta_slow=s.beta_slow,
                mscale=s.mscale,
                mscale_all_dim=s.mscale_all_dim,
                attention_factor=s.attention_factor,
                truncate=s.truncate,
            )
    return config


def save_hf_checkpoint(
    checkpoint: Checkpoint, directory: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Save config.json, model.safetensors and the tokenizer files into ``directory``."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t if isinstance(t, torch.Tensor) else t.dequantize()).to(dtype).contiguous()
        for name, t in checkpoint.weights.items()
    }
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(hf_config(checkpoint, dtype), indent=2) + "\n")
    checkpoint.tokenizer.save_hf(root)
    return root
