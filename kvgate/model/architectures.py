"""The architectures kvgate runs, each in one place: what its checkpoints call it (HF
``model_type``, GGUF ``general.architecture``), what its layers hold beyond the Llama core,
and every weight it reads, under HF names with their GGUF spellings.

All of them run the Llama forward pass (``llama.py``) with the differences named here:

- Llama (and Mistral, SmolLM): the core. llama.cpp stores its Q/K rows permuted.
- Qwen2 / Qwen2.5: biases on the q, k and v projections.
- Qwen3: a per-head RMSNorm on q and on k (over the head dimension) before RoPE; no biases.

Adding an architecture of this family is adding an ``Architecture`` here; the loaders, the
weight check and the forward pass read it from ``ModelConfig.arch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.errors import UnsupportedModel

if TYPE_CHECKING:
    from kvgate.model.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_name: str
    hf_class: str  # the transformers class (config.json "architectures")
    qkv_bias: bool = False
    qk_norm: bool = False
    #: llama.cpp's converter permutes Q/K rows for this architecture (undone at load).
    gguf_permutes_qk: bool = False

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every weight the forward pass reads, HF name and shape ``[out, in]``, in layer
        order (a generator: a damaged file claiming billions of layers costs nothing)."""
        h, hd = config.hidden_size, config.head_dim
        q_dim, kv_dim = config.num_heads * hd, config.num_kv_heads * hd
        inter = config.intermediate_size
        yield "model.embed_tokens.weight", (config.vocab_size, h)
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            yield p + "self_attn.q_proj.weight", (q_dim, h)
            yield p + "self_attn.k_proj.weight", (kv_dim, h)
            yield p + "self_attn.v_proj.weight", (kv_dim, h)
            yield p + "self_attn.o_proj.weight", (h, q_dim)
            if self.qkv_bias:
                yield p + "self_attn.q_proj.bias", (q_dim,)
                yield p + "self_attn.k_proj.bias", (kv_dim,)
                yield p + "self_attn.v_proj.bias", (kv_dim,)
            if self.qk_norm:
                yield p + "self_attn.q_norm.weight", (hd,)
                yield p + "self_attn.k_norm.weight", (hd,)
            yield p + "mlp.gate_proj.weight", (inter, h)
            yield p + "mlp.up_proj.weight", (inter, h)
            yield p + "mlp.down_proj.weight", (h, inter)
            yield p + "input_layernorm.weight", (h,)
            yield p + "post_attention_layernorm.weight", (h,)
        yield "model.norm.weight", (h,)
        if not config.tie_word_embeddings:
            yield "lm_head.weight", (config.vocab_size, h)


LLAMA = Architecture(
    "llama", ("llama", "mistral"), "llama", "LlamaForCausalLM", gguf_permutes_qk=True
)
QWEN2 = Architecture("qwen2", ("qwen2",), "qwen2", "Qwen2ForCausalLM", qkv_bias=True)
QWEN3 = Architecture("qwen3", ("qwen3",), "qwen3", "Qwen3ForCausalLM", qk_norm=True)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3)}

#: GGUF tensor names -> HF names: whole names, and the per-layer suffixes of "blk.{i}.".
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def architecture(name: str) -> Architecture:
    """By kvgate's name (``ModelConfig.architecture``)."""
    return ARCHITECTURES[name]


def from_hf_model_type(model_type: object, file: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    known = sorted(t for a in ARCHITECTURES.values() for t in a.hf_model_types)
    raise UnsupportedModel(
        f"{file}: model_type {model_type!r} is not supported (supported: {', '.join(known)})",
        path=file,
    )


def from_gguf_name(name: object, file: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if name == arch.gguf_name:
            return arch
    known = ", ".join(a.gguf_name for a in ARCHITECTURES.values())
    raise UnsupportedModel(
        f"{file}: architecture {name!r} is not supported (supported: {known})", path=file
    )
