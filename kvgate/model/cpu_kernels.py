"""Native CPU kernels, compiled on first use with the system C compiler and loaded by ctypes.

The sources (``csrc/``) are plain C with no torch headers, so a build takes about a second.
Each shared object is built for one ISA level (``cpu_isa``: the CPU's best, or
``$KVGATE_CPU_ISA``) and cached per source and level (``~/.cache/kvgate/kernels`` or
``$KVGATE_KERNEL_CACHE``). Each library says which vector path it holds (its
``kvgate_isa()``); where it holds none, or there is no compiler, or a build fails, the loaders
return None and callers use the plain-PyTorch path: the kernels are an acceleration, never a
requirement. ``KVGATE_DISABLE_KERNELS=1`` forces the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvgate.model import cpu_isa

log = logging.getLogger("kvgate.model")

_COMMON = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
#: Attention may reassociate sums (vectorised dot products); the fused element-wise ops and
#: the linear must round exactly where they promise, so no fast-math and no FMA contraction.
_FLAGS = {
    # Reassociation for vectorised sums, but keep infinities (the online softmax starts at
    # -inf). Not -ffast-math itself: with it gcc links crtfastmath.o into the library, whose
    # constructor turns on flush-to-zero for the whole thread that loads it, changing every
    # other float computation in the process (subnormals become 0).
    "paged_decode.c": [
        *_COMMON,
        "-fno-math-errno",
        "-fassociative-math",
        "-fno-signed-zeros",
        "-fno-trapping-math",
        "-freciprocal-math",
    ],
    "encoder_attention.c": [*_COMMON, "-fno-math-errno", "-fno-trapping-math"],
    "fused_ops.c": [*_COMMON, "-fno-fast-math", "-ffp-contract=off"],
    "decode_layers.c": [*_COMMON, "-fno-fast-math", "-ffp-contract=off"],
    "linear.c": [*_COMMON, "-fno-fast-math", "-ffp-contract=off"],
    "qlinear.c": [*_COMMON, "-fno-fast-math", "-ffp-contract=off"],
}


def _cache_dir() -> Path:
    root = os.environ.get("KVGATE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvgate" / "kernels"


def build_library(name: str, level: str) -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler found; using the PyTorch path")
        return None
    csrc = resources.files("kvgate.model").joinpath("csrc")
    source = csrc.joinpath(name).read_text()
    # Shared headers travel with every source (and are part of what the cache key covers).
    headers = {h.name: h.read_text() for h in csrc.iterdir() if h.name.endswith(".h")}
    march = list(cpu_isa.MARCH[level]) if cpu_isa.is_x86() else []
    flags = [*_FLAGS[name], *march]
    signature = source + "".join(headers.values()) + " ".join(flags) + platform.machine()
    key = hashlib.sha256(signature.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name.removesuffix('.c')}-{level}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / name
        src.write_text(source)
        for header, text in headers.items():
            (Path(tmp) / header).write_text(text)
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [cc, *flags, str(src), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            log.warning("building %s for %s failed:\n%s", name, level, proc.stderr[-2000:])
            return None
        os.replace(out, target)  # atomic: concurrent builders never see half a file
    return target


def fn_address(fn: Any) -> int:  # a ctypes function of a loaded library
    """A loaded kernel's address, for C code that calls it through a pointer."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


@dataclass(frozen=True)
class KernelCall:
    """How a native linear's kernel is called, for C code that calls it directly
    (``native_decode``): the function's address, the packed weight, scales and bias
    (addresses or None), ``kind`` ``widen`` (``linear_avx2``) or ``dot`` (``linear_bf16``),
    N, K and the weight type of ``linear_avx2``."""

    fn: int
    weight: int
    scale: int | None
    bias: int | None
    kind: str
    n: int
    k: int
    wtype: int


@dataclass(frozen=True)
class KernelLibrary:
    """One compiled source, built for one ISA level.

    ``isa`` is what the library itself says its vector path was compiled for
    (``kvgate_isa()``: ``amx`` (the linear only), ``avx512bf16``, ``avx2`` or ``generic``),
    not a guess from flags.
    """

    source: str
    level: str
    isa: str
    lib: ctypes.CDLL


@functools.cache
def load_library(name: str, level: str | None = None) -> KernelLibrary | None:
    """``csrc/<name>`` built for ``level`` (default: ``cpu_isa.default_level()``).

    The one fallback rule for every native op: None, and PyTorch does the work, when the
    library has no vector path (a ``generic`` build), when there is no compiler or the build
    fails, or when ``KVGATE_DISABLE_KERNELS`` is set.
    """
    if os.environ.get("KVGATE_DISABLE_KERNELS"):
        return None
    level = level or cpu_isa.default_level()
    try:
        path = build_library(name, level)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable (%s); using PyTorch", name, exc)
        return None
    lib.kvgate_isa.restype = ctypes.c_char_p
    isa = lib.kvgate_isa().decode()
    if isa == "generic":
        return None
    return KernelLibrary(name, level, isa, lib)


class PagedDecodeKernel:
    """ctypes front of the attention kernels (``paged_decode.c``); calls release the GIL.

    ``__call__``: paged decode, bf16 or float32. ``decode_quantized``: the same over int8 or
    fp8 rows with their scales (``kv_codec.py``). ``prefill``: every prompt slice of a step on
    AMX tiles or AVX-512 registers (``prefills`` says whether this build has them).
    ``causal_softmax``: the softmax of the short-prompt prefill path, bf16 only (None when not
    compiled in).
    """

    def __init__(self, library: KernelLibrary) -> None:
        self.isa = library.isa
        lib = library.lib
        self._softmax = lib.causal_softmax_bf16
        self._softmax.restype = ctypes.c_int
        self._softmax.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._softmax.argtypes += [ctypes.c_int, ctypes.c_float]
        self._fns = {torch.bfloat16: lib.paged_decode_bf16, torch.float32: lib.paged_decode_f32}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [
                *([ctypes.c_void_p] * 6),
                *([ctypes.c_int] * 4),
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_float,
            ]

        self._q8 = {
            torch.bfloat16: lib.paged_decode_q8_bf16,
            torch.float32: lib.paged_decode_q8_f32,
        }
        for fn in self._q8.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [
                *([ctypes.c_void_p] * 6),
                *([ctypes.c_int] * 4),
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_float,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
        self._prefill = lib.prefill_attention_bf16
        self._prefill.restype = ctypes.c_int
        self._prefill.argtypes = [*([ctypes.c_void_p] * 6), *([ctypes.c_int] * 4)]
        self._prefill.argtypes += [ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int64]
        self._prefill.argtypes += [ctypes.c_int, ctypes.c_void_p]
        ready = int(lib.prefill_attention_ready())
        #: ``prefill`` runs (AVX512-BF16 builds); False: callers use PyTorch.
        self.prefills = ready > 0
        #: ``prefill`` runs on AMX tiles (the tile state granted), not on AVX-512 registers.
        self.prefill_tiles = ready == 2
        self._rows = lib.decode_rows_q8_bf16
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        self._rows.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        #: Every e4m3 byte's value, for the fp8 rows (the table the kernel reads them by).
        self._fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        self._fp8 = self._fp8.view(torch.float8_e4m3fn).float().contiguous()

    def decode_quantized(
        self,
        q: torch.Tensor,  # [B, Hq, D] contiguous
        k_cache: torch.Tensor,  # [Hkv, N, BS, D + 4 groups] uint8
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        groups: int,  # scales a row
        fp8: bool,
    ) -> torch.Tensor:
        b, hq, d = q.shape
        hkv, n, bs, _ = k_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        table = self._fp8.data_ptr() if fp8 else None
        rc = self._q8[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), b, hkv, hq // hkv, d, n, bs,
            tables.numel() // b, scale, groups, table,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"quantized paged decode refused shapes: dim={d}, groups={groups}")
        return out

    def decode_rows(
        self,
        rows: torch.Tensor,  # [..., D + 4 groups] uint8: quantized rows (``kv_codec.py``)
        dim: int,
        groups: int,
        fp8: bool,
    ) -> torch.Tensor | None:
        """[..., dim] bf16, byte for byte ``KVCodec.decode`` for a bf16 model (a prefill's
        gathered context); None where the kernel refuses the shape."""
        rows = rows.contiguous()
        out = torch.empty((*rows.shape[:-1], dim), dtype=torch.bfloat16)
        table = self._fp8.data_ptr() if fp8 else None
        n = rows.numel() // rows.shape[-1] if rows.numel() else 0
        if self._rows(rows.data_ptr(), out.data_ptr(), n, dim, groups, table) != 0:
            return None
        return out

    def prefill(
        self,
        q: torch.Tensor,  # [T, Hq, D] bf16, the step's rows
        k_cache: torch.Tensor,  # [Hkv, N, BS, D] bf16 or [Hkv, N, BS, D + 4 groups] uint8
        v_cache: torch.Tensor,
        slices: torch.Tensor,  # [S, 4] int64: token_start, token_end, start_pos, table_at
        tables: torch.Tensor,  # [sum of the slices' blocks] int64
        scale: float,
        max_keys: int,  # the longest context of a slice
        groups: int = 0,  # quantized rows (``kv_codec.py``): their scales a row; 0: bf16
        fp8: bool = False,
    ) -> torch.Tensor | None:
        """Causal attention of every prefill slice of a step (``prefill_bf16.h``: AMX tiles,
        or vdpbf16ps on AVX-512), into a new [T, Hq, D] tensor whose other rows (decodes) are
        left for the caller; None where the kernel refuses (no AVX512-BF16, a head size it
        does not take)."""
        hq, d = q.shape[1], q.shape[2]
        hkv, n, bs, _ = k_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        rc = self._prefill(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slices.data_ptr(),
            tables.data_ptr(), out.data_ptr(), slices.shape[0], hkv, hq // hkv, d, n, bs,
            scale, max_keys, groups, self._fp8.data_ptr() if fp8 else None,
        )  # fmt: skip
        return out if rc == 0 else None

    def decode_address(self, dtype: torch.dtype) -> int:
        """The paged decode kernel's address, for C code that calls it (``native_decode``)."""
        return fn_address(self._fns[dtype])

    def decode_q8_address(self, dtype: torch.dtype) -> int:
        """The quantized-row paged decode's address (``decode_quantized``'s kernel)."""
        return fn_address(self._q8[dtype])

    def fp8_table_address(self) -> int:
        """The 256 e4m3 values as float32, the quantized decode's fp8 table."""
        return int(self._fp8.data_ptr())

    #: Scratch limits compiled into the kernel (MAX_G, MAX_D, MAX_BS in paged_decode.c).
    MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 64

    def supports(self, dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> bool:
        """Whether the kernel handles this case; callers use PyTorch otherwise."""
        return (
            dtype in self._fns
            and group <= self.MAX_GROUP
            and head_dim <= self.MAX_HEAD_DIM
            and block_size <= self.MAX_BLOCK_SIZE
        )

    def __call__(
        self,
        q: torch.Tensor,  # [B, Hq, D] contiguous
        k_cache: torch.Tensor,  # [Hkv, N, BS, D]
        v_cache: torch.Tensor,
        tables: torch.Tensor,  # [B * max_blocks] int64
        lens: torch.Tensor,  # [B] int64
        scale: float,
    ) -> torch.Tensor:
        b, hq, d = q.shape
        hkv, n, bs, _ = k_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        max_blocks = tables.numel() // b
        rc = self._fns[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), b, hkv, hq // hkv, d, n, bs, max_blocks, scale,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"paged decode kernel refused shapes: heads/kv={hq // hkv}, dim={d}")
        return out

    #: Longest key row of ``causal_softmax`` (MAX_SOFTMAX_KEYS in paged_decode.c).
    MAX_SOFTMAX_KEYS = 4096

    def causal_softmax(self, scores: torch.Tensor, scale: float) -> torch.Tensor | None:
        """scores [..., R, n] bf16, row r being query r % n -> causal softmax probabilities
        in bf16, zero past each query; None where the kernel cannot take it."""
        n = scores.shape[-1]
        if scores.dtype != torch.bfloat16 or n > self.MAX_SOFTMAX_KEYS:
            return None
        scores = scores.contiguous()
        probs = torch.empty_like(scores)
        rc = self._softmax(scores.data_ptr(), probs.data_ptr(), scores.numel() // n, n, scale)
        return probs if rc == 0 else None


def load_paged_decode(level: str | None = None) -> PagedDecodeKernel | None:
    """The compiled attention kernels, or None (then PyTorch is used; see ``load_library``)."""
    lib = load_library("paged_decode.c", level)
    return PagedDecodeKernel(lib) if lib else None


class EncoderAttentionKernel:
    """ctypes front of ``encoder_attention.c``: bidirectional attention over packed sequences
    (the embedder's), bf16 or float32; calls release the GIL."""

    def __init__(self, library: KernelLibrary) -> None:
        self.isa = library.isa
        lib = library.lib
        self._fns = {
            torch.bfloat16: lib.encoder_attention_bf16,
            torch.float32: lib.encoder_attention_f32,
        }
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [*([ctypes.c_void_p] * 3), *([ctypes.c_int] * 3), ctypes.c_float]

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel takes this case (D % 32 == 0, D <= 256 in the C source)."""
        return dtype in self._fns and head_dim % 32 == 0 and head_dim <= 256

    def __call__(self, qkv: torch.Tensor, starts: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv [T, 3 * heads * D] (q | k | v, heads inside each), starts [S + 1] int64 token
        offsets of the packed sequences -> attention output [T, heads * D], same dtype."""
        t, width = qkv.shape
        d = width // (3 * heads)
        qkv, starts = qkv.contiguous(), starts.contiguous()
        out = torch.empty(t, heads * d, dtype=qkv.dtype)
        fn = self._fns[qkv.dtype]
        rc = fn(qkv.data_ptr(), out.data_ptr(), starts.data_ptr(), starts.numel() - 1, heads, d,
                d**-0.5)  # fmt: skip
        if rc != 0:
            raise ValueError(f"encoder attention kernel refused: heads={heads}, dim={d} ({rc})")
        return out


def load_encoder_attention(level: str | None = None) -> EncoderAttentionKernel | None:
    """The compiled encoder attention (``encoder_attention.c``), or None: PyTorch's."""
    lib = load_library("encoder_attention.c", level)
    return EncoderAttentionKernel(lib) if lib else None


def load_fused_ops_lib(level: str | None = None) -> KernelLibrary | None:
    """The compiled bf16 element-wise kernels (see ``model/ops.py``), or None."""
    return load_library("fused_ops.c", level)


def load_linear_lib(level: str | None = None) -> KernelLibrary | None:
    """The compiled linear kernels (see ``model/linear.py``), or None."""
    return load_library("linear.c", level)


def load_quant_lib(level: str | None = None) -> KernelLibrary | None:
    """The compiled kernels over GGML block formats (see ``model/quant_linear.py``), or None."""
    return load_library("qlinear.c", level)


def torch_bf16_gemm() -> bool:
    """Whether PyTorch has fast bf16 GEMMs here (oneDNN's bf16 path: AVX512-BF16 or AMX, or
    AVX-512 / AVX-NE-CONVERT emulating it) at this process's level: the one probe behind
    bf16 attention matmuls, the oneDNN-packed linear and the embedder's precision."""
    return cpu_isa.lets_torch_use_bf16() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class CpuKernels:
    """The one capability probe: each native op's compiled library for one ISA level, each
    asked what its vector path is. None for an op: PyTorch does it (same rule for all)."""

    level: str
    linear: KernelLibrary | None
    attention: PagedDecodeKernel | None
    elementwise: KernelLibrary | None
    quant: KernelLibrary | None = None  # qlinear.c: weights in GGML block formats

    @classmethod
    def probe(cls, level: str | None = None, *, enabled: bool = True) -> CpuKernels:
        """Build (or find cached) and load every library for ``level`` (default: this
        process's, ``cpu_isa.default_level()``, which raises on a level the CPU lacks)."""
        level = level or cpu_isa.default_level()
        if not enabled:
            return cls(level, None, None, None)
        return cls(
            level,
            load_linear_lib(level),
            load_paged_decode(level),
            load_fused_ops_lib(level),
            load_quant_lib(level),
        )

    def paths(self) -> dict[str, str]:
        """Op -> the vector path its library was compiled with, or ``torch``."""
        return {
            "linear": self.linear.isa if self.linear else "torch",
            "attention": self.attention.isa if self.attention else "torch",
            "elementwise": self.elementwise.isa if self.elementwise else "torch",
            "quant": self.quant.isa if self.quant else "torch",
        }
