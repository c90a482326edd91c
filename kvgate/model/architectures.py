"""The architectures kvgate runs: what an architecture record holds, and the registry of
them. Each record lives in its model module with the forward pass that runs it (``llama.py``:
Llama, Mistral, SmolLM, Qwen2, Qwen3; ``gemma3.py``: Gemma 3; ``deepseek.py``: DeepSeek-V2
and V3; ``deepseek_v4.py``: DeepSeek-V4), and says there what its
checkpoints call it (HF ``model_type``, GGUF ``general.architecture``), the config fields of its
own (``hf_fields``, ``gguf_fields``, ``export_hf``), every weight it reads under HF names
(``weights``), with the GGUF spellings that differ, and its model class.

The loaders (``hf_loader.py``, ``gguf_loader.py``, ``hf_export.py``) are generic: they read
the fields every decoder has and ask the record for the rest. Adding an architecture is a
model module with its record, and one line in ``_MODULES`` below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from kvgate.errors import UnsupportedModel

if TYPE_CHECKING:
    from kvgate.model.config import ModelConfig
    from kvgate.model.decoder import DecoderModel

#: The model modules that declare architectures (each an ``ARCHITECTURES`` tuple), imported
#: when the registry is first read.
_MODULES = (
    "kvgate.model.llama",
    "kvgate.model.gemma3",
    "kvgate.model.deepseek",
    "kvgate.model.deepseek_v4",
)


class GGUFMetadata(Protocol):
    """Typed reads of a GGUF file's metadata (``gguf_loader``): a missing or ill-typed value
    is a clear load error naming the file and key."""

    def pos_int(self, key: str, default: int | None = None) -> int: ...

    def pos_f32(self, key: str, default: float | None = None) -> float: ...

    def opt_pos_float(self, key: str) -> float | None: ...

    def opt_int(self, key: str) -> int | None: ...

    def opt_bool(self, key: str) -> bool | None: ...

    def opt_str(self, key: str) -> str | None: ...


def _no_fields(*_: Any) -> dict[str, Any]:
    return {}


def _as_is(_: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    return hf


def _never(*_: Any) -> bool:
    return False


def _same_name(name: str) -> str:
    return name


def _as_loaded(weights: dict[str, Any], _: ModelConfig) -> dict[str, Any]:
    return weights


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_name: str | None  # None: no GGUF file of it is read
    hf_class: str  # the transformers class (config.json "architectures")
    #: Its model class (a ``DecoderModel``), which runs its forward pass.
    model: type[DecoderModel[Any]]
    #: Every weight the forward pass reads, HF name and shape ``[out, in]``, in layer order
    #: (a generator: a damaged file claiming billions of layers costs nothing).
    weight_shapes: Callable[[Architecture, ModelConfig], Iterator[tuple[str, tuple[int, ...]]]]
    qkv_bias: bool = False
    qk_norm: bool = False
    #: llama.cpp's converter permutes Q/K rows for this architecture (undone at load).
    gguf_permutes_qk: bool = False
    #: Norm weights are stored as ``w`` and scale by ``norm_offset + w`` (Gemma: 1); llama.cpp
    #: stores ``norm_offset + w``.
    norm_offset: float = 0.0
    #: Per-layer GGUF names that differ from ``GGUF_LAYER_NAMES`` for this architecture.
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    #: A token that ends a turn (and so generation) where the file names only ``<eos>``.
    end_of_turn: str | None = None
    #: The chat template for files that carry none (GGUF of a base model).
    default_chat_template: str | None = None
    #: ModelConfig fields of its own from a config.json (``raw``, ``file``); a ``"rope"``
    #: entry, (theta, scaling), replaces the generic RoPE reading, a ``"hidden_act"`` the
    #: SiLU check, a ``"layer_types"`` the generic sliding-window rule.
    hf_fields: Callable[[Mapping[str, Any], str], dict[str, Any]] = _no_fields
    #: The same from a GGUF file's metadata (its key prefix, its layer count).
    gguf_fields: Callable[[GGUFMetadata, str, int], dict[str, Any]] = _no_fields
    #: A config.json for transformers from the generic one ``export_hf(config, hf)``.
    export_hf: Callable[[ModelConfig, dict[str, Any]], dict[str, Any]] = _as_is
    #: Weights a checkpoint may hold that the forward pass does not read (DeepSeek-V3's
    #: multi-token-prediction layers): dropped at load instead of refused.
    unused_weight: Callable[[ModelConfig, str], bool] = _never
    #: A GGUF's tensors (under the HF names ``gguf_layer_names`` gives them) made into the
    #: weights ``weights`` lists, where llama.cpp stores them otherwise (DeepSeek's experts
    #: stacked in one tensor a layer, its ``kv_b`` split in two).
    gguf_tensors: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] = _as_loaded
    #: The name ``weights`` lists for a tensor of a Hugging Face directory, where checkpoints
    #: spell them otherwise (DeepSeek-V4's own names, with or without ``model.``).
    hf_name: Callable[[str], str] = _same_name

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
        return self.weight_shapes(self, config)


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


@cache
def _registry() -> dict[str, Architecture]:
    """Every architecture, by kvgate's name, from the model modules."""
    found: dict[str, Architecture] = {}
    for module in _MODULES:
        for arch in importlib.import_module(module).ARCHITECTURES:
            found[arch.name] = arch
    return found


def architectures() -> tuple[Architecture, ...]:
    return tuple(_registry().values())


def architecture(name: str) -> Architecture:
    """By kvgate's name (``ModelConfig.architecture``)."""
    return _registry()[name]


def from_hf_model_type(model_type: object, file: str) -> Architecture:
    for arch in architectures():
        if model_type in arch.hf_model_types:
            return arch
    known = sorted(t for a in architectures() for t in a.hf_model_types)
    raise UnsupportedModel(
        f"{file}: model_type {model_type!r} is not supported (supported: {', '.join(known)})",
        path=file,
    )


def from_gguf_name(name: object, file: str) -> Architecture:
    for arch in architectures():
        if arch.gguf_name is not None and name == arch.gguf_name:
            return arch
    known = ", ".join(a.gguf_name for a in architectures() if a.gguf_name is not None)
    raise UnsupportedModel(
        f"{file}: architecture {name!r} is not supported (supported: {known})", path=file
    )
