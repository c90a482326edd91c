"""Random GGML blocks of every natively multiplied type, for the kernel tests.

Every byte is random (nibbles, high bits, 6-bit scales and mins, int8 values) except the
float16 scale fields, set to finite values of a realistic size so that sums stay finite.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgate.model.quant_tensor import NATIVE_QTYPES, QuantTensor

#: Byte offsets of each type's float16 fields inside a block: (scale, min-or-None).
_F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}

QTYPES = sorted(NATIVE_QTYPES, key=int)


def random_blocks(
    qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator
) -> np.ndarray:
    """uint8 [rows, k / block * bytes] of random blocks; scales of ~1e-3..1e-2 (a min of
    either sign), as a real layer's weights of magnitude ~0.05."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = rows * (k // block)
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for i, at in enumerate(_F16_FIELDS[qtype]):
        values = rng.uniform(1e-3, 1e-2, nb) * (rng.choice([-1, 1], nb) if i else 1)
        raw[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, -1)


def random_quant(
    qtype: GGMLQuantizationType, rows: int, k: int, seed: int = 0, name: str = "w"
) -> QuantTensor:
    raw = random_blocks(qtype, rows, k, np.random.default_rng(seed))
    return QuantTensor(qtype, (rows, k), torch.from_numpy(raw), name)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> the float64 values the kernels multiply: per block of 32, int8
    round-to-nearest-even of x / d, d = max |x| / 127 (float32 arithmetic), times d."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    # a true division (``127.0 / t`` is t.reciprocal() * 127 in torch: another rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-128, 127)
    return (q.double() * d.double()).reshape(m, k)
