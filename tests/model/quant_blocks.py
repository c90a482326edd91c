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


#: The K-quants' activations on AVX2 (``quant_linear.activation_block`` 256, ``csrc/qlinear.c``
#: quantize_x256): a float step D per 256 inputs times an integer multiplier in [1, KQ_S] per 32.
KQ_S = 32


def activation_steps(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q, step) as the kernels quantize it: q the int8 values, step
    [M, K] each input's step (float64), so x ~ q step. ``block`` 32: step = max |x| / 127 per
    32 inputs. ``block`` 256 (the K-quants on AVX2): step = D s_b, D = max |x| / (127 KQ_S)
    over the 256 and s_b = ceil(KQ_S amax_b / amax) per 32 (1 for zeros). q is the round to
    nearest even of x / step, in the kernels' float32 arithmetic."""
    m, k = x.shape
    # a true division throughout (``127.0 / t`` is t.reciprocal() * 127 in torch: another rounding)
    if block == 32:
        blocks = x.float().reshape(m, k // 32, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        step = (amax / 127.0).double().expand(m, k // 32, 32)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    else:
        assert block == 256, block
        blocks = x.float().reshape(m, k // 256, 8, 32)
        am = blocks.abs().amax(-1, keepdim=True)  # [M, K / 256, 8, 1]
        amax = am.amax(-2, keepdim=True)  # [M, K / 256, 1, 1]
        d = amax / (127.0 * KQ_S)
        pos = amax > 0
        s = torch.where(pos, torch.ceil((am * KQ_S).div(amax)), torch.ones_like(am)).clamp(1, KQ_S)
        inv = torch.where(
            pos, torch.full_like(am, 127.0 * KQ_S).div(amax * s), torch.zeros_like(am)
        )
        step = (d.double() * s.double()).expand(m, k // 256, 8, 32)
    q = torch.round(blocks * inv).clamp(-128, 127)
    return q.reshape(m, k), step.reshape(m, k)


def quantize_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [M, K] float32 -> the float64 values the kernels multiply (``activation_steps``):
    q step."""
    q, step = activation_steps(x, block)
    return q.double() * step
