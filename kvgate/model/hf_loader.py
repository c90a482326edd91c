"""Load a Hugging Face model directory (config.json + safetensors + tokenizer.json).

Supports the ``model_type``s of the architectures in ``architectures.py``'s registry (each
reads the config fields of its own: ``Architecture.hf_fields``), single-file or sharded
safetensors
(``model.safetensors.index.json``). Tensors keep their stored dtype (bf16 stays bf16).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch

from kvgate.errors import CorruptWeights, ModelNotFound, UnsupportedModel
from kvgate.hf_files import int_list, read_json_object
from kvgate.model.architectures import from_hf_model_type
from kvgate.model.checkpoint import Checkpoint, check_weights, make_config
from kvgate.model.config import ModelConfig, RopeScaling
from kvgate.tokenizer import Tokenizer

__all__ = ["config_from_hf", "load_hf_dir"]

_INDEX = "model.safetensors.index.json"
# Buffers some older checkpoints saved alongside the weights; recomputed by the forward pass.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_dir(path: str | os.PathLike[str]) -> Checkpoint:
    """Read config, tokenizer and weights from a Hugging Face directory.

    Raises:
        ModelNotFound: config.json, tokenizer.json or the safetensors are missing.
        CorruptWeights: a file does not parse, or a tensor is missing or mis-shaped.
        UnsupportedModel: a model type or feature the Llama forward pass cannot run.
    """
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(
            f"{root}: no config.json (not a Hugging Face model directory)", path=str(config_file)
        )
    raw = read_json_object(config_file)
    generation_file = root / "generation_config.json"
    generation = read_json_object(generation_file, missing_ok=True)
    tokenizer = Tokenizer.from_hf_dir(root)
    config = config_from_hf(raw, str(config_file), generation=generation, tokenizer=tokenizer)

    weights, sources = _load_safetensors(root)
    rename = config.arch.hf_name
    weights = {rename(name): w for name, w in weights.items()}
    sources = {rename(name): file for name, file in sources.items()}
    if config.tie_word_embeddings:
        # Some tied checkpoints also store the (identical) head; the forward pass reuses embed.
        weights.pop("lm_head.weight", None)
    unused = config.arch.unused_weight
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES) or unused(config, n)]:
        del weights[name]
    # Where a missing tensor should have been: the shard index, or the one weights file.
    files = set(sources.values())
    where = str(root)
    if (root / _INDEX).is_file():
        where = str(root / _INDEX)
    elif len(files) == 1:
        where = files.pop()
    check_weights(weights, config, where, sources)
    return Checkpoint(config=config, weights=dict(weights), tokenizer=tokenizer, path=str(root))


def config_from_hf(
    raw: Mapping[str, Any],
    file: str,
    *,
    generation: Mapping[str, Any] | None = None,
    tokenizer: Tokenizer | None = None,
) -> ModelConfig:
    """A ModelConfig from a parsed config.json (transformers v4 or v5 layout).

    EOS ids are config.json's plus generation_config.json's, falling back to the tokenizer's.

    Raises:
        UnsupportedModel: model type, activation, rope type or bias layout we cannot run.
        CorruptWeights: a required key is missing or has the wrong type.
    """
    model_type = raw.get("model_type")
    arch = from_hf_model_type(model_type, file)
    # The architecture's own fields (e.g. Gemma 3's activation, layer types and RoPE).
    extra = arch.hf_fields(raw, file)

    act = raw.get("hidden_act", "silu")
    if "hidden_act" not in extra and act != "silu":
        raise UnsupportedModel(
            f"{file}: hidden_act {act!r} is not supported (only silu)", path=file
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModel(f"{file}: mlp_bias is not supported", path=file)
    quantized = raw.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
        raise UnsupportedModel(
            f"{file}: quantized checkpoints ({method}) are not supported; use a bf16 or fp32 "
            "directory, or a GGUF file",
            path=file,
        )
    # Biases on q, k and v are an architecture's own (Qwen2's). Elsewhere attention_bias
    # also biases o_proj, which this forward pass does not have.
    if not arch.qkv_bias and raw.get("attention_bias"):
        raise UnsupportedModel(f"{file}: attention_bias (o_proj bias) is not supported", path=file)

    # Sizes are validated by make_config; the two used in arithmetic here are checked first.
    hidden = positive_int(raw, "hidden_size", file)
    heads = positive_int(raw, "num_attention_heads", file)
    max_pos = raw.get("max_position_embeddings")
    window = _sliding_window(raw, arch.name)
    if "layer_types" not in extra and window is not None and isinstance(max_pos, int):
        # Attention within a window as long as the whole context is full attention: capping
        # the context keeps the plain (full-attention) forward pass exact.
        max_pos = min(max_pos, window)

    rope_theta, rope_scaling = extra.pop("rope") if "rope" in extra else read_rope(raw, file)
    gen = generation or {}
    eos = int_list(raw.get("eos_token_id")) + int_list(gen.get("eos_token_id"))
    if not eos and tokenizer is not None:
        eos = list(tokenizer.eos_token_ids)
    bos = raw.get("bos_token_id")
    if not isinstance(bos, int) and tokenizer is not None:
        bos = tokenizer.bos_token_id
    fields: dict[str, Any] = dict(
        architecture=arch.name,
        vocab_size=raw.get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=raw.get("intermediate_size"),
        num_layers=raw.get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=raw.get("tie_word_embeddings", False) is True,
        rope_scaling=rope_scaling,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
    fields.update(extra)  # the architecture's own readings win (DeepSeek's head dim)
    return make_config(file, **fields)


def positive_int(raw: Mapping[str, Any], key: str, file: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CorruptWeights(f"{file}: {key} must be a positive integer, got {value!r}", path=file)
    return value


def _sliding_window(raw: Mapping[str, Any], model_type: str) -> int | None:
    window = raw.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return window


def read_rope(raw: Mapping[str, Any], file: str) -> tuple[Any, RopeScaling | None]:
    """(rope_theta, scaling) from v4 ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``.
    rope_theta is returned as read; make_config checks it."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, Mapping):
            raise CorruptWeights(f"{file}: {key} must be an object, got {value!r}", path=file)
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "llama3", "yarn"):
        raise UnsupportedModel(
            f"{file}: rope type {kind!r} is not supported (supported: default, linear, llama3, "
            "yarn)",
            path=file,
        )

    def number(key: str, default: float | None = None) -> float:
        value = scaling.get(key, default)
        if not is_number(value) or not value > 0:
            raise CorruptWeights(
                f"{file}: {kind} rope scaling {key} must be a positive number, got {value!r}",
                path=file,
            )
        return float(value)

    if kind == "yarn":
        return theta, _yarn(scaling, raw.get("max_position_embeddings"), number, file)
    factor = number("factor")
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=factor)
    low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    if high <= low or not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise CorruptWeights(
            f"{file}: llama3 rope scaling needs high_freq_factor > low_freq_factor and a positive "
            f"original_max_position_embeddings, got {high}, {low}, {original!r}",
            path=file,
        )
    return theta, RopeScaling("llama3", factor, low, high, original)


def _yarn(
    scaling: Mapping[str, Any], max_pos: object, number: Callable[..., float], file: str
) -> RopeScaling:
    """YaRN's settings, with transformers' defaults for those a config leaves out (the
    original context: the model's own)."""
    original = scaling.get("original_max_position_embeddings") or max_pos
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise CorruptWeights(
            f"{file}: yarn rope scaling needs a positive original_max_position_embeddings, "
            f"got {original!r}",
            path=file,
        )
    factor = number("factor")  # required, as transformers' validation requires it

    def optional(key: str) -> float | None:
        return None if not scaling.get(key) else number(key)  # 0, as transformers reads it: unset

    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=number("beta_fast") if scaling.get("beta_fast") else 32.0,
        beta_slow=number("beta_slow") if scaling.get("beta_slow") else 1.0,
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _load_safetensors(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of the directory, and which file each came from."""
    from safetensors import safe_open

    index_file = root / _INDEX
    if index_file.is_file():
        weight_map = read_json_object(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptWeights(f"{index_file}: no weight_map", path=str(index_file))
        files = sorted({str(f) for f in weight_map.values()})
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        if any(root.glob("*.bin")):
            raise UnsupportedModel(
                f"{root}: only safetensors weights are supported, not .bin", path=str(root)
            )
        raise ModelNotFound(f"{root}: no *.safetensors weights", path=str(root))

    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for name in files:
        file = root / name
        if not file.is_file():
            raise ModelNotFound(f"{file}: shard listed in {_INDEX} is missing", path=str(file))
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    weights[key] = f.get_tensor(key)
                    sources[key] = str(file)
        except Exception as exc:  # SafetensorError, OSError on truncated/garbage files
            raise CorruptWeights(
                f"{file}: cannot read safetensors ({exc})", path=str(file)
            ) from exc
    return weights, sources
