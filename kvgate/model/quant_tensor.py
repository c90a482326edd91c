"""A weight matrix kept in a GGML block format, as the GGUF file stores it.

``QuantTensor`` is a view of the file's memory map (no copy, nothing dequantized): its rows
are the output features, each ``row_bytes`` long, made of whole blocks of 32 or 256 inputs.
The native kernels (``quant_linear.py``, ``csrc/qlinear.c``) multiply these blocks as they
are; ``dequantize`` gives the float32 values llama.cpp's formats stand for (the fallback path
and the reference of the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["NATIVE_QTYPES", "QuantTensor", "dequantize_blocks", "quantize_q8_0"]

#: The block formats ``csrc/qlinear.c`` multiplies natively (GGML's enum values).
NATIVE_QTYPES = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


def dequantize_blocks(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray:
    """float32 values [*shape] of a tensor's bytes (a new, writable array).

    Q8_0 / Q4_0 / Q4_1 over the whole tensor at once with gguf.quants' float32 arithmetic
    (bit-identical, several times faster); the other types through gguf.quants itself.
    """
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).copy().reshape(shape)
    blocks = raw.reshape(-1, type_size)
    if qtype == GGMLQuantizationType.Q8_0:  # [d: f16][32 x int8]
        d = blocks[:, :2].view(np.float16).astype(np.float32)
        return (blocks[:, 2:].view(np.int8).astype(np.float32) * d).reshape(shape)
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        # [d: f16]([m: f16])[16 bytes]: low nibbles are elements 0..15, high nibbles 16..31.
        head = 2 if qtype == GGMLQuantizationType.Q4_0 else 4
        d = blocks[:, :2].view(np.float16).astype(np.float32)
        qs = blocks[:, head:]
        q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)
        if qtype == GGMLQuantizationType.Q4_0:
            return (d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(shape)
        m = blocks[:, 2:4].view(np.float16).astype(np.float32)
        return ((d * q.astype(np.float32)) + m).reshape(shape)
    from gguf.quants import dequantize  # the general (slower) path

    rows = raw.reshape(-1, shape[-1] // block * type_size)
    return np.array(dequantize(rows, qtype), dtype=np.float32).reshape(shape)


@dataclass(frozen=True)
class QuantTensor:
    """``shape`` [N, K] (out, in) weights in ``qtype`` blocks; ``data`` uint8 [N, row_bytes],
    usually a view of the file's memory map. ``name``: the GGUF tensor, for messages."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    data: torch.Tensor
    name: str

    def __post_init__(self) -> None:
        n, k = self.shape
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        if k % block or tuple(self.data.shape) != (n, k // block * type_size):
            raise ValueError(
                f"tensor {self.name!r}: {self.qtype.name} rows of {k} inputs do not fit "
                f"{tuple(self.data.shape)} bytes"
            )

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])

    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self) -> int:
        return int(self.data.numel())

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the values the blocks stand for (gguf.quants' arithmetic)."""
        with np.errstate(all="ignore"):  # damaged scales: inf/NaN, found by check_weights
            values = dequantize_blocks(self.data.numpy(), self.qtype, self.shape)
        return torch.from_numpy(values)

    def take_rows(self, index: torch.Tensor) -> QuantTensor:
        """Rows ``index`` (a permutation, or a subset), copied out of the map."""
        rows = self.data.index_select(0, index)
        return QuantTensor(self.qtype, (int(index.numel()), self.shape[1]), rows, self.name)


def quantize_q8_0(weight: torch.Tensor, name: str) -> QuantTensor:
    """Dense weights [N, K] (K a multiple of 32) -> Q8_0 blocks ([d: f16][32 x int8] per 32
    inputs of each row), for ``--quantization int8`` on a bf16 / float32 checkpoint: the
    layers then run on the same W8A8 kernels as a GGUF's Q8_0 tensors.

    d = max |w| / 127 of the block, rounded to float16 first, and q = round(w / d) with that
    stored d (clamped to +-127: the rounding of d may shrink it by half an ulp), so the
    blocks stand for exactly the values the kernels multiply. An all-zero block has d = 0.
    """
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"tensor {name!r}: Q8_0 needs inputs in blocks of 32, got {k}")
    w = weight.detach().float().reshape(n, k // 32, 32)
    d = (w.abs().amax(dim=2, keepdim=True) / 127.0).to(torch.float16)
    safe = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    q = torch.round(w / safe).clamp_(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=2)  # [N, K/32, 34]
    return QuantTensor(
        GGMLQuantizationType.Q8_0, (n, k), blocks.reshape(n, k // 32 * 34).contiguous(), name
    )
