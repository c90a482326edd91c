"""``dtype auto``'s choices: the compute dtype, and whether a GGUF's blocks stay native."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from kvgate.model.precision import (
    NATIVE_BLOCKS_MIN_BYTES,
    dequantized,
    native_blocks,
    native_blocks_min_bytes,
)
from kvgate.model.quant_tensor import QuantTensor
from tests.model.quant_blocks import random_quant


def _weights() -> dict[str, torch.Tensor | QuantTensor]:
    return {
        "a": random_quant(GGMLQuantizationType.Q4_K, 64, 512, seed=1),
        "b": random_quant(GGMLQuantizationType.Q6_K, 32, 512, seed=2),
        "norm": torch.ones(512),
    }


def test_blocks_stay_native_from_the_size_where_they_gain() -> None:
    weights = _weights()
    bf16 = 2 * (64 + 32) * 512
    keep, why = native_blocks(weights, min_bytes=bf16)
    assert keep and "Q4_K+Q6_K" in why
    keep, why = native_blocks(weights, min_bytes=bf16 + 1)
    assert not keep and "dequantized" in why


def test_the_size_from_which_blocks_stay_native_follows_the_kernels() -> None:
    # VNNI blocks beside an AVX-512 bf16 linear: measured faster at every size.
    assert native_blocks_min_bytes({"quant": "avx512bf16", "linear": "avx512bf16"}) == 0
    # Beside AMX tiles for bf16, or on a pair not measured, small models stay bf16.
    for paths in (
        {"quant": "avx512bf16", "linear": "amx"},
        {"quant": "avx2", "linear": "torch"},
        {"quant": "torch", "linear": "avx512bf16"},
        {},
    ):
        assert native_blocks_min_bytes(paths) == NATIVE_BLOCKS_MIN_BYTES, paths


def test_a_checkpoint_without_blocks_has_nothing_to_keep() -> None:
    keep, why = native_blocks({"w": torch.zeros(4, 4)}, min_bytes=0)
    assert not keep and "no block" in why


def test_dequantized_weights_are_the_blocks_values() -> None:
    weights = _weights()
    dense = dequantized(weights)
    assert set(dense) == set(weights)
    for name, w in weights.items():
        got = dense[name]
        assert isinstance(got, torch.Tensor)
        want = w.dequantize() if isinstance(w, QuantTensor) else w
        assert torch.equal(got, want)
