"""The element-wise glue of a decoder layer, behind one interface with two implementations.

``TorchLayerOps`` is plain PyTorch and the reference. ``FusedCpuLayerOps`` replaces each
group of small PyTorch ops with one native bf16 kernel (``csrc/fused_ops.c``): RoPE + KV-cache
write (about 15 ops), residual add + RMSNorm (about 10), SiLU * up (3). Per-op dispatch is
most of their cost at decode sizes.

Results are bit-identical to the PyTorch path, so greedy bf16 outputs do not move: the
kernels round to bf16 exactly where the separate torch ops round, the norm sums its squares
in torch's own summation order, and SiLU uses the same exp algorithm as torch's vectorised
one (SLEEF's); the tests check the norm on random rows and SiLU on every bf16 value.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch
import torch.nn.functional as F

from kvgate.model.attention import AttentionBackend, AttentionMetadata, NativeKVLayout
from kvgate.model.cpu_kernels import KernelLibrary, fn_address
from kvgate.model.rope import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm exactly: normalise in float32, cast back, then scale.

    ``F.rms_norm`` computes in float32 internally and rounds once, so on a bf16 input it is
    bit-identical to HF's upcast, four ops and downcast (checked in the tests).
    """
    return weight * F.rms_norm(x, weight.shape, eps=eps)


class LayerOps(Protocol):
    def add_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place (x None: nothing to add); return RMSNorm(residual)."""
        ...

    def rope_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
        positions: torch.Tensor,  # [T]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        key_offset: torch.Tensor | None = None,  # [Hkv, D] float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k, write k and v to the cache; return q [T,Hq,D], k, v [T,Hkv,D].
        ``key_offset``: subtracted from the rotated k (rounded to the model's dtype) before
        both are written and returned (quantized K/V: ``kv_codec.key_offset``)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate) * up."""
        ...


class TorchLayerOps:
    def __init__(
        self, rope: RotaryEmbedding, attention: AttentionBackend, heads: tuple[int, int, int]
    ) -> None:
        self.rope = rope
        self.attention = attention
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def add_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if x is not None:
            residual.add_(x)
        return rms_norm(residual, weight, eps)

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        key_offset: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hq, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # The same positions serve every layer of the step: look the tables up once.
        if self._tables is None or self._tables[0] is not positions:
            self._tables = (positions, *self.rope.tables(positions))
        _, cos, sin = self._tables
        q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rotary(q.view(t, hq, d), cos, sin)
        k = apply_rotary(k.view(t, hkv, d), cos, sin)
        if key_offset is not None:
            k = (k.float() - key_offset).to(k.dtype)
        v = v.view(t, hkv, d)
        self.attention.write_kv(k, v, k_cache, v_cache, meta)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


class FusedCpuLayerOps:
    """bf16; bit-identical to ``TorchLayerOps``. The fused RoPE + KV write writes the cache
    in place only where the attention backend says it may (``native_layout``: bf16,
    head-major, the model's head shape); elsewhere it is the fallback's (rotate, then the
    backend's ``write_kv``).

    Built only where ``fused_ops.c`` has a vector path (AVX2 or AVX512-BF16; see
    ``cpu_kernels.load_library``); on both the kernels beat PyTorch at every row count
    (2 threads, SmolLM2's shapes). AVX512-BF16 Xeon: RoPE 8 vs 25 us for 1 row, 70 vs 409 us
    for 1024; norm 3 vs 11 us for 1 row, 136 vs 204 us for 1024. AVX2 AMD EPYC: RoPE 38 vs
    135 us for 1 row (mostly this wrapper), 569 vs 1958 us for 1024; norm 11 vs 60 us and
    519 vs 1498 us; SiLU * up 12 vs 23 us and 838 vs 3549 us.
    """

    def __init__(
        self,
        library: KernelLibrary,
        rope: RotaryEmbedding,
        heads: tuple[int, int, int],
        fallback: TorchLayerOps,
    ) -> None:
        self.isa = library.isa
        self.rope = rope
        self.fallback = fallback
        self.attention = fallback.attention
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        lib = library.lib
        self._rope = lib.rope_write_kv_bf16
        self._rope.restype = None
        self._rope.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 4 + [ctypes.c_int64]
        # The same, writing K/V as quantized rows (``kv_codec``: int8 or fp8 with scales).
        self._rope_q8 = lib.rope_write_kv_q8
        self._rope_q8.restype = None
        self._rope_q8.argtypes = [*self._rope.argtypes, ctypes.c_int, ctypes.c_int]
        self._rope_q8.argtypes += [ctypes.c_void_p]  # the key offset, float32 [Hkv, D]
        self._add_norm = lib.add_rms_norm_bf16
        self._add_norm.restype = ctypes.c_int
        self._add_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2

    def kernel_addresses(self) -> dict[str, int]:
        """Each kernel's address, for C code that calls them (``native_decode``)."""
        return {
            "rope_write_kv": fn_address(self._rope),
            "rope_write_kv_q8": fn_address(self._rope_q8),
            "add_norm": fn_address(self._add_norm),
            "silu_mul": fn_address(self._silu_mul),
        }

    def add_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if not residual.is_contiguous() or (x is not None and not x.is_contiguous()):
            return self.fallback.add_norm(x, residual, weight, eps)
        t, h = residual.shape
        out = torch.empty_like(residual)
        rc = self._add_norm(
            0 if x is None else _ptr(x), _ptr(residual), _ptr(weight), _ptr(out), t, h, eps
        )
        if rc != 0:
            return self.fallback.add_norm(x, residual, weight, eps)
        return out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        key_offset: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hq, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        layout = self.attention.native_layout(k_cache, v_cache)
        if (
            not self.writes(layout)
            or not qkv.is_contiguous()
            or (key_offset is not None and (layout is None or layout.codec is None))
        ):
            return self.fallback.rope_write_kv(qkv, positions, k_cache, v_cache, meta, key_offset)
        assert layout is not None
        q = torch.empty((t, hq, d), dtype=qkv.dtype)
        k = torch.empty((t, hkv, d), dtype=qkv.dtype)
        args = (
            _ptr(qkv), _ptr(positions), _ptr(self.rope.cos), _ptr(self.rope.sin_signed),
            _ptr(meta.slot_mapping), _ptr(q), _ptr(k), _ptr(k_cache), _ptr(v_cache),
            t, hq, hkv, d, layout.num_slots,
        )  # fmt: skip
        if layout.codec is None:
            self._rope(*args)
        else:
            offset = 0 if key_offset is None else _ptr(key_offset)
            self._rope_q8(*args, layout.kv_groups, layout.codec == "fp8", offset)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        return q, k, v

    def writes(self, layout: NativeKVLayout | None) -> bool:
        """Whether the fused kernel may write caches of this layout (rows of the model's KV
        heads, bf16 or int8/fp8 with scales, for a bf16 model; the kernel writes slot s of
        head h at ``h * num_slots + s``)."""
        if layout is None or (layout.num_kv_heads, layout.head_dim) != (
            self.num_kv_heads,
            self.head_dim,
        ):
            return False
        if layout.codec is None:
            return layout.dtype == torch.bfloat16
        return (
            layout.codec in ("int8", "fp8")
            and layout.dtype == torch.uint8
            and self.rope.cos.dtype == torch.bfloat16
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous():
            return self.fallback.silu_mul(gate_up)
        t, two_i = gate_up.shape
        out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
        self._silu_mul(_ptr(gate_up), _ptr(out), t, two_i // 2)
        return out
