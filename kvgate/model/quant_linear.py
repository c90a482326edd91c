"""Linear layers and embedding lookups over weights kept in GGML block formats.

``QuantLinear`` calls ``kvg_qlinear`` (``csrc/qlinear.c``): W stays in the GGUF file's blocks
(``QuantTensor`` views of its memory map, read in place), x is quantized to int8 per block of
32 inputs (for the K-quants on AVX2, a step per 256 times an integer per 32:
``activation_block``), and the products are integer dot products (AVX512-VNNI, or AVX2).
Several tensors can make one layer (q, k and v; gate and up), each in its own format, without
a copy. ``QuantEmbedding`` dequantizes just the rows a step looks up, to exactly the float32
values of the dequantized path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from gguf import GGMLQuantizationType

from kvgate.model.cpu_kernels import KernelCall, KernelLibrary, fn_address
from kvgate.model.quant_tensor import NATIVE_QTYPES, QuantTensor

__all__ = ["QuantEmbedding", "QuantLinear", "activation_block", "native_qtype"]


class _Seg(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
        ("type", ctypes.c_int32), ("pad", ctypes.c_int32),
    ]  # fmt: skip


class _Weight(ctypes.Structure):
    _fields_ = [("segs", ctypes.POINTER(_Seg)), ("nsegs", ctypes.c_int32), ("k", ctypes.c_int32)]


def native_qtype(library: KernelLibrary | None, t: QuantTensor) -> bool:
    """Whether ``library`` (``qlinear.c``) multiplies ``t``'s block format natively."""
    return (
        library is not None
        and t.qtype in NATIVE_QTYPES
        and bool(library.lib.kvg_qtype_supported(int(t.qtype)))
    )


def activation_block(library: KernelLibrary, qtype: GGMLQuantizationType) -> int:
    """How ``library`` quantizes x for its products with ``qtype`` columns: 32, int8 with a
    float step per 32 inputs; 256 (the K-quants on AVX2), a float step per 256 inputs times
    an integer in [1, 32] per 32 (``csrc/qlinear.c``, quantize_x256)."""
    return int(library.lib.kvg_qact_block(int(qtype)))


def _bf16_tiles(library: KernelLibrary) -> bool:
    """Whether ``library`` multiplies blocks on bf16 tiles (``kvg_qlinear_bf16_tiles``: the
    amx build, where Linux granted the tile state)."""
    probe = getattr(library.lib, "kvg_qbf16_tiles", None)
    return probe is not None and bool(probe())


class _Blocks:
    """The C description of rows of one or more ``QuantTensor``s (same K), stacked."""

    def __init__(self, parts: Sequence[QuantTensor]) -> None:
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError(f"stacked tensors differ in inputs: {[p.shape for p in parts]}")
        self.parts = tuple(parts)  # keeps the maps' views alive while C points into them
        self.n = sum(p.shape[0] for p in parts)
        self.k = k
        self._segs = (_Seg * len(parts))()
        for seg, p in zip(self._segs, parts, strict=True):
            data = p.data if p.data.is_contiguous() else p.data.contiguous()
            seg.data, seg.rows, seg.row_bytes = data.data_ptr(), p.shape[0], p.row_bytes
            seg.type = int(p.qtype)
        self.struct = _Weight(self._segs, len(parts), k)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


class QuantLinear:
    """y = x W^T + b with W the rows of ``parts`` (stacked), in their block formats.

    ``io_dtype``: bf16 or float32 activations; ``float32_out``: float32 sums out (the LM
    head's logits) whatever x is; else y in ``io_dtype``, each sum rounded once.
    """

    def __init__(
        self,
        parts: Sequence[QuantTensor],
        bias: torch.Tensor | None,
        library: KernelLibrary,
        *,
        io_dtype: torch.dtype,
        float32_out: bool = False,
    ) -> None:
        self._blocks = _Blocks(parts)
        self.out_features, self.in_features = self._blocks.n, self._blocks.k
        self.io_dtype = io_dtype
        self.float32_out = float32_out
        self.bias = bias.float().contiguous() if bias is not None else None
        #: (rows, ``activation_block``) of each part, in order
        self.activation_parts = tuple(
            (p.shape[0], activation_block(library, p.qtype)) for p in parts
        )
        self._fn = library.lib.kvg_qlinear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
        self._weight = ctypes.addressof(self._blocks.struct)
        self._bias = self.bias.data_ptr() if self.bias is not None else None
        self._out_dtype = torch.float32 if float32_out else io_dtype
        self._tiles = None  # kvg_qlinear_bf16_tiles, where this library runs it
        if io_dtype == torch.bfloat16 and self.in_features % 32 == 0 and _bf16_tiles(library):
            self._tiles = library.lib.kvg_qlinear_bf16_tiles
            self._tiles.restype = ctypes.c_int
            self._tiles.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(p.qtype.name for p in self._blocks.parts)

    def weight_bytes(self) -> int:
        bias = self.bias.numel() * 4 if self.bias is not None else 0
        return self._blocks.nbytes() + bias

    @property
    def out_dtype(self) -> torch.dtype:
        return self._out_dtype

    def _output(self, m: int, out: torch.Tensor | None) -> torch.Tensor:
        """``out`` (a contiguous [m, N] of the output dtype: rows of a larger output) or a
        new tensor."""
        if out is None:
            return torch.empty((m, self.out_features), dtype=self._out_dtype)
        if out.shape != (m, self.out_features) or out.dtype != self._out_dtype:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} for {m} rows of {self}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        return out

    def __call__(  # [M, K] -> [M, N]
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.shape[0]
        y = self._output(m, out)
        if m == 0:
            return y
        if x.dtype != self.io_dtype:
            raise ValueError(f"linear built for {self.io_dtype} activations, got {x.dtype}")
        io_bf16 = 1 if self.io_dtype == torch.bfloat16 else 0
        n, k, f32 = self.out_features, self.in_features, int(self.float32_out)
        rc = self._fn(x.data_ptr(), self._weight, None, self._bias, y.data_ptr(), m, n, k, f32,
                      io_bf16)  # fmt: skip
        if rc != 0:
            raise ValueError(f"quantized linear refused {tuple(x.shape)} x {self.qtypes} ({rc})")
        return y

    @property
    def prompt_tiles(self) -> bool:
        """Whether ``prompt`` runs on bf16 tiles here (else it is ``__call__``)."""
        return self._tiles is not None

    def prompt(  # [M, K] bf16 -> [M, N]
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The product for prompt tokens: on an AMX CPU, the blocks widened to bf16 and
        multiplied on bf16 tiles (x unquantized; 1.3-2.4x the int8 tiles' rate from 32 rows
        on, a quarter of it for one row). A row's output does not depend on its batch here
        either, but differs from ``__call__``'s: the caller keeps each token on one of the
        two for good (prompt positions here, generated ones on ``__call__``)."""
        if self._tiles is None:
            return self(x, out)
        if not x.is_contiguous():
            x = x.contiguous()
        if x.dtype != torch.bfloat16:
            raise ValueError(f"bf16 tiles take bf16 activations, got {x.dtype}")
        m = x.shape[0]
        y = self._output(m, out)
        if m:
            n, k = self.out_features, self.in_features
            rc = self._tiles(x.data_ptr(), self._weight, self._bias, y.data_ptr(), m, n, k,
                             int(self.float32_out))  # fmt: skip
            if rc != 0:
                raise ValueError(f"bf16 tiles refused {tuple(x.shape)} x {self.qtypes} ({rc})")
        return y

    def kernel_call(self) -> KernelCall | None:
        """For the fused decode layers (bf16 in and out): ``kvg_qlinear`` has
        ``linear_avx2``'s signature, its ``wtype`` being ``float32_out`` (0 here)."""
        if self.io_dtype != torch.bfloat16 or self.float32_out:
            return None
        return KernelCall(fn_address(self._fn), self._weight, None, self._bias, "widen",
                          self.out_features, self.in_features, 0)  # fmt: skip


class QuantEmbedding:
    """Rows of a block-quantized table [V, H], dequantized as a step looks them up."""

    def __init__(self, table: QuantTensor, library: KernelLibrary, dtype: torch.dtype) -> None:
        self._blocks = _Blocks([table])
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.shape
        self._fn = library.lib.kvg_qdequant_rows
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        self._weight = ctypes.addressof(self._blocks.struct)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, H]
        ids = ids.to(torch.int64).contiguous()
        bf16 = self.dtype == torch.bfloat16
        out = torch.empty((ids.numel(), self.embedding_dim),
                          dtype=torch.bfloat16 if bf16 else torch.float32)  # fmt: skip
        if ids.numel():
            rc = self._fn(self._weight, ids.data_ptr(), ids.numel(), self.num_embeddings,
                          out.data_ptr(), int(bf16))  # fmt: skip
            if rc != 0:
                raise IndexError(f"token id out of range 0..{self.num_embeddings - 1}")
        return out if out.dtype == self.dtype else out.to(self.dtype)
