"""The architectures kvgate runs, each in one place: what its checkpoints call it (HF
``model_type``, GGUF ``general.architecture``), what its layers hold beyond the Llama core,
and every weight it reads, under HF names with their GGUF spellings.

Two forward passes (``model_class``) serve them, with the differences named here:

- Llama (and Mistral, SmolLM), ``llama.py``: the core. llama.cpp stores its Q/K rows permuted.
- Qwen2 / Qwen2.5: biases on the q, k and v projections.
- Qwen3: a per-head RMSNorm on q and on k (over the head dimension) before RoPE; no biases.
- Gemma 3 (text), ``gemma3.py``: q/k norms, "sandwich" norms (after attention and around the
  MLP as well), norms that scale by ``1 + w``, GeGLU, embeddings scaled by sqrt(hidden),
  sliding-window layers between global ones (``ModelConfig.layer_types``) with their own
  RoPE base. llama.cpp stores its norms as ``1 + w`` (undone at load).

Adding an architecture is adding an ``Architecture`` here (and, if its layers differ in kind,
a model class in ``models.py``); the loaders, the weight check and the forward pass read it
from ``ModelConfig.arch``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
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
    #: The forward pass: ``"llama"`` or ``"gemma3"`` (``models.py``).
    model_class: str = "llama"
    #: Norms after attention and before and after the MLP (Gemma): four per layer.
    sandwich_norms: bool = False
    #: Norm weights are stored as ``w`` and scale by ``norm_offset + w`` (Gemma: 1); llama.cpp
    #: stores ``norm_offset + w``.
    norm_offset: float = 0.0
    #: Per-layer GGUF names that differ from ``GGUF_LAYER_NAMES`` for this architecture.
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    #: A token that ends a turn (and so generation) where the file names only ``<eos>``.
    end_of_turn: str | None = None
    #: The chat template for files that carry none (GGUF of a base model).
    default_chat_template: str | None = None

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
            if self.sandwich_norms:
                yield p + "pre_feedforward_layernorm.weight", (h,)
                yield p + "post_feedforward_layernorm.weight", (h,)
        yield "model.norm.weight", (h,)
        if not config.tie_word_embeddings:
            yield "lm_head.weight", (config.vocab_size, h)


LLAMA = Architecture(
    "llama", ("llama", "mistral"), "llama", "LlamaForCausalLM", gguf_permutes_qk=True
)
QWEN2 = Architecture("qwen2", ("qwen2",), "qwen2", "Qwen2ForCausalLM", qkv_bias=True)
QWEN3 = Architecture("qwen3", ("qwen3",), "qwen3", "Qwen3ForCausalLM", qk_norm=True)
# Gemma's turn format (a system message opens the first user turn, as Gemma's own template does).
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (m['content'] | trim) + '\\n\\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{%- if m['role'] != 'assistant' %}{{ ns.system }}{% set ns.system = '' %}{% endif -%}"
    "{{ (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"
)

GEMMA3 = Architecture(
    "gemma3",
    ("gemma3_text",),
    "gemma3",
    "Gemma3ForCausalLM",
    qk_norm=True,
    model_class="gemma3",
    sandwich_norms=True,
    norm_offset=1.0,
    gguf_layer_names={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    end_of_turn="<end_of_turn>",
    default_chat_template=_GEMMA_TEMPLATE,
)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, GEMMA3)}

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


def gguf_layer_name(arch: Architecture, suffix: str) -> str | None:
    """The HF per-layer name of GGUF's ``blk.{i}.<suffix>`` in ``arch``, or None."""
    return arch.gguf_layer_names.get(suffix) or GGUF_LAYER_NAMES.get(suffix)


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
