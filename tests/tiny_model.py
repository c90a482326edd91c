"""Tiny random-weight Llama checkpoints for fast tests, saved the way HF checkpoints arrive."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvgate.tokenizer import Tokenizer

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    # Larger than HF's default 0.02: peakier logits, so greedy choices are not near-ties
    # that float rounding could flip.
    "initializer_range": 0.25,
}


def build_tiny_llama(
    directory: Path, tokenizer: Tokenizer, seed: int = 0, **overrides: Any
) -> Path:
    """Save a random-weight LlamaForCausalLM (fp32 safetensors) plus tokenizer into directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return directory


def tiny_qwen3(seed: int = 3) -> Any:
    """A random-weight Qwen3ForCausalLM of the tiny shape (per-head q/k norms made to matter:
    HF initialises them to one)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_LLAMA, head_dim=16))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def tiny_qwen2(seed: int = 3) -> Any:
    """A random-weight Qwen2ForCausalLM of the tiny shape, its q/k/v biases made to matter
    (HF initialises them to zero)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA, use_sliding_window=False))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model.eval()


def build_tiny_qwen3(directory: Path, tokenizer: Tokenizer, seed: int = 3) -> Path:
    """``tiny_qwen3`` saved as an HF directory (fp32 safetensors) with ``tokenizer``."""
    tiny_qwen3(seed).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return directory


def build_tiny_qwen2(directory: Path, tokenizer: Tokenizer, seed: int = 5) -> Path:
    """A random-weight Qwen2ForCausalLM of the tiny shape with q/k/v biases, the key bias
    ~100x the keys on the channels RoPE hardly turns (as Qwen2.5's: ``kv_codec.key_offset``),
    saved as an HF directory (fp32 safetensors) with ``tokenizer``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA, use_sliding_window=False))
    d = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]  # 16
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.normal_(0, 0.5)
            heads = attn.k_proj.bias.view(-1, d)  # [Hkv, D]; channels d/2 - 1 and d - 1
            heads[:, d // 2 - 1] = torch.tensor([150.0, -90.0])  # turn slowest: 0.65 rad
            heads[:, d - 1] = torch.tensor([-120.0, 60.0])  # over 2048 positions
    model.eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return directory
