"""A loaded model: config, weights (Hugging Face Llama names) and tokenizer, from any source.

``load_checkpoint`` accepts a registry alias (``"smollm2"``), a ``.gguf`` file or a Hugging Face
directory and dispatches to :mod:`kvgate.model.gguf_loader` or :mod:`kvgate.model.hf_loader`.
Both loaders produce weights under the same names and layout, checked by :func:`check_weights`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.config import ModelConfig
from kvgate.model.quant_tensor import QuantTensor
from kvgate.tokenizer import Tokenizer

#: A loaded weight: a tensor, or a matrix kept in a GGML block format (``quant_tensor.py``).
Weight = torch.Tensor | QuantTensor

__all__ = [
    "Checkpoint",
    "Weight",
    "check_weights",
    "expected_weight_shapes",
    "load_checkpoint",
    "make_config",
]


@dataclass
class Checkpoint:
    """Everything needed to run a model.

    ``weights``: CPU tensors under Hugging Face names (see :func:`expected_weight_shapes`),
    Q/K rows in the HF ``rotate_half`` layout, in their stored dtype (float32 for dequantized GGUF
    tensors). ``lm_head.weight`` is present only when the embeddings are not tied.
    ``path``: the file or directory it was read from.
    """

    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: Tokenizer
    path: str


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name the forward pass reads, with its shape ``[out, in]`` (HF Linear layout)."""
    return dict(_iter_expected(config))


def _iter_expected(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    return config.arch.weights(config)


_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


def make_config(file: str, **fields: Any) -> ModelConfig:
    """``ModelConfig(**fields)`` after checking every size is a positive int and eps/theta are
    positive numbers; any problem is raised naming ``file`` (the config a loader read).

    Raises:
        CorruptWeights: a size or constant has the wrong type or sign.
        UnsupportedModel: the head layout is not one the forward pass supports.
    """
    for key in _POSITIVE_INTS:
        value = fields.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CorruptWeights(
                f"{file}: {key} must be a positive integer, got {value!r}", path=file
            )
    for key in ("rms_norm_eps", "rope_theta"):
        value = fields.get(key)
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise CorruptWeights(
                f"{file}: {key} must be a positive number, got {value!r}", path=file
            )
        fields[key] = float(value)
    try:
        return ModelConfig(**fields)
    except UnsupportedModel as exc:  # ModelConfig names no file
        raise UnsupportedModel(f"{file}: {exc.message}", path=file) from exc


def check_weights(
    weights: Mapping[str, Weight],
    config: ModelConfig,
    path: str,
    sources: Mapping[str, str] | None = None,
) -> None:
    """Check ``weights`` has exactly the expected names and shapes.

    ``sources`` maps a weight name to the file it came from (shards), for the error message;
    otherwise ``path`` is named.

    Raises:
        CorruptWeights: a tensor is missing, has the wrong shape, or holds inf/NaN.
        UnsupportedModel: a tensor this forward pass would ignore is present.
    """
    seen: set[str] = set()
    for name, shape in _iter_expected(config):
        if name not in weights:
            raise CorruptWeights(f"{path}: missing tensor {name!r}", path=path)
        got = tuple(weights[name].shape)
        if got != shape:
            where = (sources or {}).get(name, path)
            raise CorruptWeights(
                f"{where}: tensor {name!r} has shape {list(got)}, expected {list(shape)}",
                path=where,
            )
        # Blocks kept quantized are not read here (start-up would read the whole file).
        w = weights[name]
        if isinstance(w, torch.Tensor) and w.is_floating_point() and not bool(w.isfinite().all()):
            where = (sources or {}).get(name, path)
            raise CorruptWeights(f"{where}: tensor {name!r} has inf/NaN values", path=where)
        seen.add(name)
    extra = sorted(set(weights) - seen)
    if extra:
        where = (sources or {}).get(extra[0], path)
        raise UnsupportedModel(
            f"{where}: unexpected tensor {extra[0]!r} (and {len(extra) - 1} more); "
            "this architecture variant is not supported",
            path=where,
        )


def load_checkpoint(model: str | os.PathLike[str], *, keep_quantized: bool = False) -> Checkpoint:
    """Load a model by alias (``"smollm2"``), ``.gguf`` file path or Hugging Face directory.

    ``keep_quantized``: a GGUF's block-quantized matrices stay in their blocks (``load_gguf``).

    Raises:
        ModelNotFound: unknown path, or the aliased package is not installed.
        CorruptWeights: a truncated/garbage file, a missing or wrongly shaped tensor.
        UnsupportedModel: an architecture or feature the Llama forward pass cannot run.
    """
    # Imported here: both loaders import Checkpoint from this module.
    from kvgate.model.gguf_loader import is_gguf_file, load_gguf
    from kvgate.model.hf_loader import load_hf_dir
    from kvgate.model.registry import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return load_hf_dir(path)
    if is_gguf_file(path):
        return load_gguf(path, keep_quantized=keep_quantized)
    if path.suffix == ".safetensors":
        raise UnsupportedModel(
            f"{path}: pass the directory holding config.json and the safetensors, not the file",
            path=str(path),
        )
    raise UnsupportedModel(
        f"{path}: not a GGUF file (no GGUF magic) nor a Hugging Face model directory",
        path=str(path),
    )
