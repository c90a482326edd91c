"""Write a transformers model as llama.cpp's convert_hf_to_gguf.py would, for the loaders'
round trips: llama.cpp's tensor names, Q/K rows permuted for Llama, norms stored as 1 + w for
Gemma, and SmolLM2's vocabulary (the one the tiny HF directories carry)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.model.architectures import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, architecture
from kvgate.model.gguf_loader import _map, _parse_header


def _gguf_names(arch: str) -> dict[str, str]:
    """HF per-layer suffix -> GGUF suffix for ``arch`` (the loader's own map, inverted)."""
    a = architecture(arch)
    names = {hf: gguf for gguf, hf in GGUF_LAYER_NAMES.items()}
    names.update({hf: gguf for gguf, hf in a.gguf_layer_names.items()})
    return names


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_smollm2_vocab(writer: Any, smollm2_gguf_path: Path) -> None:
    """SmolLM2's vocabulary (the one the tiny HF directories carry), BOS 1 and EOS 2."""
    fields, _, _ = _parse_header(_map(str(smollm2_gguf_path)), str(smollm2_gguf_path))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(
    path: Path,
    model: Any,
    arch: str,
    smollm2_gguf_path: Path,
    edit: Callable[[Any], None] | None = None,
) -> None:
    from gguf import GGUFWriter

    c = model.config
    a = architecture(arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = GGUFWriter(str(path), a.gguf_name)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    add_smollm2_vocab(writer, smollm2_gguf_path)
    if edit is not None:
        edit(writer)
    layer_names = _gguf_names(arch)
    global_names = {hf: gguf for gguf, hf in GGUF_GLOBAL_NAMES.items()}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if a.norm_offset and name.endswith("norm.weight"):
            array = array + np.float32(a.norm_offset)
        if a.gguf_permutes_qk and name.endswith("q_proj.weight"):
            array = _permute(array, c.num_attention_heads)
        elif a.gguf_permutes_qk and name.endswith("k_proj.weight"):
            array = _permute(array, c.num_key_value_heads)
        if name in global_names:
            gguf_name = global_names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


#: The eight-token byte-level BPE vocabulary of the hand-made tiny GGUF files.
TINY_TOKENS = ["<s>", "</s>", "a", "b", "c", "ab", "Ġ", "abc"]


def write_tiny_header(
    writer: Any, *, layers: int, hidden: int, inter: int, heads: int, kv_heads: int
) -> None:
    """The metadata of a hand-made tiny GGUF (a ``gguf.GGUFWriter``): its sizes, RoPE and norm
    constants, and the ``TINY_TOKENS`` vocabulary with BOS 0 and EOS 1."""
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_merges(["a b", "ab c"])
    writer.add_token_types([3, 3, 1, 1, 1, 1, 1, 1])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
