"""Dense layers: y = x W^T + b, with the fastest kernel this device offers.

``LinearFactory`` is the one place that picks a layer's kernel, from the dtype, the weight
format (``quantization``) and what the compiled library says its vector path is:

- bf16 with AVX512-BF16: ``Bf16DotLinear`` (``csrc/linear.c``), the weight packed once into
  panels of 32 output columns in which each pair of input features sits side by side, the
  layout vdpbf16ps multiplies. Against oneDNN's pre-packed linear on SmolLM2's layers (2
  threads): 1.55x at 1 row, 1.23x at 32 and 64, equal from 512 rows up.
- bf16 with AVX2 (any x86-64 CPU since ~2015, AVX-512 ones without BF16 too): ``WidenLinear``,
  bf16 weights in panels of 16 columns, widened to float32 in registers; oneDNN cannot pack
  bf16 there and ``F.linear`` in bf16 is several times slower than float32.
- int8 weights (``quantization="int8"`` or its synonym ``int8-b32``): made Q8_0 blocks at load
  (a scale per 32 inputs) and run on ``QuantLinear`` below, the W8A8 kernels a GGUF's Q8_0
  tensors take. On the AMD EPYC (Zen 4, SmolLM2, 2 threads) against the int16-activation
  path that follows: 32 streams 354 against 268 tok/s, batch-1 decode 138-150 against 173
  tok/s, perplexity +0.64% against bf16. Where ``qlinear.c`` is not built, or K is not whole
  blocks of 32: ``WidenLinear``, as integer dot products: each row of x quantized to
  int16 with one scale, int8 weights widened to int16, ``vpmaddwd``; half the bytes of bf16
  per decoded token, and 3 instructions per 16 multiply-adds where widening int8 to float32
  took 8 (on the AMD EPYC at one row: 32.3 GFLOP/s against 19.6 widened); with AVX512-VNNI
  (the avx512bf16 builds) ``vpdpwssd`` fuses the product and the add, same integers.
- weights kept in a GGUF's block formats (``QuantTensor``: Q4_K, Q6_K, Q8_0, ...):
  ``QuantLinear`` (``csrc/qlinear.c``), x quantized to int8 per 32 inputs, integer dot
  products on the blocks as the file holds them; a type it lacks is dequantized once at load
  (logged once per type) and takes the paths above.
- otherwise: oneDNN's pre-packed bf16 weights where oneDNN takes them (bit-identical to
  ``F.linear``); ``F.linear`` for float32 (MKL) and on GPUs.

Every native path sums each output in one float32 order whatever the batch holds, so a
sequence's logits never depend on what it is batched with; against ``F.linear`` they differ
by one bf16 ulp in a few outputs in ten thousand (a different summation order).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvgate.model import cpu_isa
from kvgate.model.cpu_kernels import KernelCall, KernelLibrary, fn_address
from kvgate.model.quant_linear import QuantEmbedding, QuantLinear, native_qtype
from kvgate.model.quant_tensor import QuantTensor, quantize_q8_0

log = logging.getLogger("kvgate.model")

#: ``int8``: one scale per output channel; ``int8-b32``: a scale per block of 32 inputs of each
#: channel, as llama.cpp's Q8_0 (12.5% more bytes than ``int8``; see ``quantize_int8``).
QUANTIZATIONS = ("int8", "int8-b32")
BLOCK = 32


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        ...

    def weight_bytes(self) -> int:
        """Bytes of weights (and scales) one call reads."""
        ...


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(int(t.numel() * t.element_size()) for t in tensors if t is not None)


class TorchLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return _nbytes(self.weight, self.bias)


class PackedCpuLinear:
    """oneDNN linear over a weight re-laid out once at load time (CPU, bf16).

    ``gelu``: GELU (erf) fused into the GEMM as oneDNN's post-op; on a bf16 [4096, 384] x
    [384, 1536] (the embedder's FFN) 26 ms against 38 ms for F.linear then F.gelu (2 Zen 4
    cores)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gelu: bool = False
    ) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias
        self._post_op, self._algorithm = ("gelu", "none") if gelu else ("none", "")
        self.out_features = weight.shape[0]
        self._bytes = _nbytes(weight, bias)

    def weight_bytes(self) -> int:
        return self._bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, self._post_op, [], self._algorithm
        )
        return out


#: Vector paths of ``linear.c`` that have ``linear_bf16``: vdpbf16ps, or AMX tiles over the
#: same packed weights (where K % 32 == 0; vdpbf16ps otherwise).
BF16_DOT_ISAS = ("avx512bf16", "amx")


def quant_path(isa: str) -> str:
    """How logs name the block kernels of a library built for ``isa``: the avx512bf16 build
    multiplies on AVX512-VNNI; the amx build on AMX-INT8 tiles (it reports ``avx512bf16``
    where Linux refused it the tile state)."""
    return {"avx512bf16": "avx512vnni", "amx": "amx"}.get(isa, isa)


class Bf16DotLinear:
    """``linear_bf16`` (AVX512-BF16, or AMX) over a weight packed once: [N / 32, K / 2, 32, 2]
    bf16.

    ``float32_out``: bf16 in, the float32 sums out unrounded (``linear_bf16_f32``: the LM
    head's logits); else bf16 out, each sum rounded once.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        library: KernelLibrary,
        *,
        float32_out: bool = False,
    ) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        # panel p, feature pair j, column c, member i = W[32 p + c, 2 j + i]
        self.packed = weight.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.float32_out = float32_out
        self._fn = library.lib.linear_bf16_f32 if float32_out else library.lib.linear_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return n % 32 == 0 and k % 2 == 0

    def weight_bytes(self) -> int:
        return _nbytes(self.packed, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        out_dtype = torch.float32 if self.float32_out else x.dtype
        y = torch.empty((m, self.out_features), dtype=out_dtype, device=x.device)
        if m == 0:
            return y
        bias = self.bias.data_ptr() if self.bias is not None else None
        rc = self._fn(
            x.data_ptr(), self.packed.data_ptr(), bias, y.data_ptr(),
            m, self.out_features, self.in_features,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"native linear refused shapes {tuple(x.shape)} x {self.in_features}")
        return y

    def kernel_call(self) -> KernelCall:
        bias = self.bias.data_ptr() if self.bias is not None else None
        return KernelCall(
            fn_address(self._fn), self.packed.data_ptr(), None, bias, "dot", self.out_features,
            self.in_features, 0,
        )  # fmt: skip


#: Column order inside a bf16 panel of 16 (see linear_avx2 in csrc/linear.c): unpacking each
#: 128-bit half with zeros then yields columns 0-7 and 8-15 in order.
_BF16_PANEL_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def quantize_int8(
    weight: torch.Tensor, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K] int8, scale float32), symmetric, q rounded to nearest (ties to
    even): ``block`` None, one scale per output channel, scale [N] = max |W[n]| / 127;
    else one per ``block`` inputs of each channel, scale [N, K / block].

    Measured on SmolLM2-135M (fp32 perplexity on 1,536 tokens of English, 16.07): per channel
    16.23 (+1.0%), blocks of 64 16.12 (+0.3%), blocks of 32 16.05 (-0.2%: lossless).
    """
    w = weight.float()
    n, k = w.shape
    groups = w.view(n, k // block, block) if block else w.view(n, 1, k)
    scale = groups.abs().amax(dim=2) / 127.0  # [N, groups]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / scale[:, :, None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return q, (scale if block else scale.view(n)).contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights ``quantize_int8`` stands for."""
    n, k = q.shape
    per_group = scale.view(n, -1, 1)  # [N, groups, 1]
    return (q.float().view(n, per_group.shape[1], -1) * per_group).view(n, k)


class WidenLinear:
    """``linear_avx2`` for bf16 or float32 activations (``io_dtype``). ``quantization``:
    None, bf16 weights in panels [N / 16, K, 16] widened to float32 in registers; ``int8``
    or ``int8-b32``, int8 weights in panels [N / 16, K / 2, 2, 8, 2] (pairs of inputs, as
    ``vpmaddwd`` takes them) times x quantized per row to int16 (see ``csrc/linear.c``)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K]: bf16, or any float dtype when ``int8``
        bias: torch.Tensor | None,
        library: KernelLibrary,
        *,
        io_dtype: torch.dtype,
        quantization: str | None = None,
    ) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.io_dtype = io_dtype
        self.scale: torch.Tensor | None = None
        if quantization is not None:
            block = BLOCK if quantization == "int8-b32" else None
            q, scale = quantize_int8(weight, block)
            # [N / 16, K / 2, 2, 8, 2]: panel, input pair, half of the panel, column, member
            self.packed = q.view(n // 16, 2, 8, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous()
            # per channel: [N]; in blocks: per panel, per block, its 16 columns' scales
            self.scale = (
                scale.view(n // 16, 16, k // BLOCK).transpose(1, 2).contiguous() if block else scale
            )
        else:
            w = weight.to(torch.bfloat16).view(n // 16, 16, k)[:, _BF16_PANEL_ORDER]
            self.packed = w.transpose(1, 2).contiguous()
        self.bias = bias.to(io_dtype).contiguous() if bias is not None else None
        self._wtype = {None: 0, "int8": 1, "int8-b32": 2}[quantization]
        self._io_bf16 = 1 if io_dtype == torch.bfloat16 else 0
        self._fn = library.lib.linear_avx2
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
        self._args = (
            self.packed.data_ptr(),
            self.scale.data_ptr() if self.scale is not None else None,
            self.bias.data_ptr() if self.bias is not None else None,
            n,
            k,
            self._wtype,
            self._io_bf16,
        )

    @staticmethod
    def supports(
        weight: torch.Tensor, io_dtype: torch.dtype, quantization: str | None = None
    ) -> bool:
        n, k = weight.shape
        inputs_fit = quantization is None or k % (BLOCK if quantization == "int8-b32" else 2) == 0
        return n % 16 == 0 and inputs_fit and io_dtype in (torch.bfloat16, torch.float32)

    def weight_bytes(self) -> int:
        return _nbytes(self.packed, self.scale, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # ~120 calls per decoded token: the constant arguments are made once (_args).
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.out_features), dtype=self.io_dtype)
        if m == 0:
            return y
        if x.dtype != self.io_dtype:
            raise ValueError(f"linear built for {self.io_dtype} activations, got {x.dtype}")
        w, scale, bias, n, k, wtype, io_bf16 = self._args
        rc = self._fn(x.data_ptr(), w, scale, bias, y.data_ptr(), m, n, k, wtype, io_bf16)
        if rc != 0:
            raise ValueError(f"native linear refused shapes {tuple(x.shape)} x {self.in_features}")
        return y

    def kernel_call(self) -> KernelCall | None:
        """None for float32 activations (the fused decode layers are bf16)."""
        if self.io_dtype != torch.bfloat16:
            return None
        w, scale, bias, n, k, wtype, _ = self._args
        return KernelCall(fn_address(self._fn), w, scale, bias, "widen", n, k, wtype)


class LogitsHead:
    """The LM head (``LinearFactory.logits``): [S, H] hidden states -> [S, V] float32."""

    def __init__(self, layer: Linear) -> None:
        self.layer = layer
        self.out_features = layer.out_features
        # float32 in: a WidenLinear built for float32 activations, whose sums stay float32
        self._float_in = isinstance(layer, WidenLinear) and layer.io_dtype == torch.float32
        # or bf16 in, float32 sums out: linear_bf16_f32, kvg_qlinear
        self.float32_sums = self._float_in or (
            isinstance(layer, Bf16DotLinear | QuantLinear) and layer.float32_out
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._float_in:
            x = x.float()
        return self.layer(x).float()

    def weight_bytes(self) -> int:
        return self.layer.weight_bytes()


def onednn_packs(dtype: torch.dtype) -> bool:
    """Probe the private oneDNN ops once: present, and equal to F.linear on a small case
    (on CPUs without AVX512BW or AVX-NE-CONVERT oneDNN refuses bf16 weights)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not cpu_isa.lets_torch_use_bf16():  # a forced level below an AVX-512 CPU's best
        return False
    try:
        w = torch.randn(48, 32).to(dtype)
        x = torch.randn(5, 32).to(dtype)
        got = PackedCpuLinear(w)(x)
        return bool(torch.equal(got, F.linear(x, w)))
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN packed linear unavailable (%s)", exc)
        return False


@functools.cache
def _log_fallback(qtype: str, isa: str) -> None:
    """Once per type and level: a block format without a native kernel here."""
    log.warning("no native kernel for %s weights (%s): dequantized at load", qtype, isa)


#: A matrix as loaded: a tensor, or rows kept in a GGML block format.
Weight = torch.Tensor | QuantTensor


@dataclass(frozen=True)
class LinearFactory:
    """Builds every dense layer of a model: ``factory(weight, bias) -> Linear``.

    ``library``: the compiled ``linear.c`` (None: no vector path, or kernels off);
    ``quantization``: None (weights in ``dtype``) or one of ``QUANTIZATIONS``;
    ``quant``: the compiled ``qlinear.c``, for weights kept in GGML blocks (None: they are
    dequantized). ``native_qtypes`` collects the block formats its layers multiply natively.
    """

    dtype: torch.dtype
    device: torch.device
    library: KernelLibrary | None
    quantization: str | None = None
    onednn: bool = False
    quant: KernelLibrary | None = None
    native_qtypes: set[str] = field(default_factory=set, compare=False)

    @classmethod
    def for_device(
        cls,
        dtype: torch.dtype,
        device: torch.device,
        library: KernelLibrary | None,
        quantization: str | None = None,
        quant: KernelLibrary | None = None,
    ) -> LinearFactory:
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None")
        cpu = device.type == "cpu"
        native = cpu and dtype in (torch.bfloat16, torch.float32)
        return cls(
            dtype,
            device,
            library if cpu else None,
            quantization,
            onednn=cpu and onednn_packs(dtype),
            quant=quant if native else None,
        )

    @property
    def path(self) -> str:
        """The kernel most layers get, for logs and ``kvgate:build_info``."""
        lib = self.library
        if self.native_qtypes and self.quant is not None:
            types = "+".join(sorted(self.native_qtypes))
            if self.quantization is not None:  # dense weights made Q8_0 blocks at load
                return f"{self.quantization}-{types}-{self.quant_isa}"
            return f"{types}-{self.quant_isa}"
        if self.quantization is not None:
            if lib is None:
                where = "dequantized-torch"
            else:  # the avx512bf16 builds run the AVX2 int8 tiles with vpdpwssd (VNNI)
                where = "avx512vnni" if lib.isa in BF16_DOT_ISAS else "avx2"
            return f"{self.quantization}-{where}"
        if self.dtype == torch.bfloat16 and lib is not None:
            return f"bf16-{lib.isa}"
        if self.onednn:
            return "bf16-onednn"
        return f"torch-{str(self.dtype).removeprefix('torch.')}"

    @property
    def quant_isa(self) -> str:
        """The vector path of the block-format kernels: AMX int8 tiles for batches (one row
        still on VNNI) where Linux grants the tile state, VNNI where built, else AVX2."""
        if self.quant is None:
            return "none"
        return quant_path(self.quant.isa)

    def _native(self, parts: Sequence[Weight]) -> list[QuantTensor] | None:
        """``parts`` when every one is in a block format ``qlinear.c`` multiplies here."""
        quant = [p for p in parts if isinstance(p, QuantTensor)]
        if len(quant) != len(parts) or not all(native_qtype(self.quant, p) for p in quant):
            return None
        self.native_qtypes.update(p.qtype.name for p in quant)
        return quant

    def _as_blocks(self, weight: torch.Tensor) -> QuantTensor | None:
        """Under ``quantization`` (``int8`` or ``int8-b32``), dense weights [N, K] as Q8_0
        blocks (a scale per 32 inputs) where ``qlinear.c`` is built and K fits: the layer
        then runs the W8A8 kernels a GGUF's Q8_0 tensors run (x quantized to int8 per 32
        inputs, ``vpdpbusd`` on VNNI). Else None: the int8 ``WidenLinear`` path below."""
        if self.quantization is None or self.quant is None or weight.shape[1] % BLOCK:
            return None
        blocks = quantize_q8_0(weight, f"{self.quantization} weights {tuple(weight.shape)}")
        return blocks if native_qtype(self.quant, blocks) else None

    def _dense(self, weight: Weight) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return weight
        if not native_qtype(self.quant, weight):  # not a native part of a mixed layer
            _log_fallback(weight.qtype.name, self.quant_isa)
        return weight.dequantize()

    def fused(self, parts: Sequence[Weight], bias: torch.Tensor | None) -> Linear:
        """One layer over the rows of ``parts`` stacked (q, k, v; gate, up): blocks kept
        as they are where native, else the dense weights concatenated."""
        quant = self._native(parts)
        if quant is not None and self.quant is not None:
            return QuantLinear(quant, bias, self.quant, io_dtype=self.dtype)
        dense = [self._dense(p) for p in parts]
        return self(dense[0] if len(dense) == 1 else torch.cat(dense), bias)

    def embedding(self, table: Weight) -> Callable[[torch.Tensor], torch.Tensor]:
        """Token ids [T] -> rows [T, H] in ``dtype``: blocks dequantized as looked up."""
        if (
            isinstance(table, QuantTensor)
            and self.quant is not None
            and native_qtype(self.quant, table)
        ):
            return QuantEmbedding(table, self.quant, self.dtype)
        dense = self._dense(table).to(device=self.device, dtype=self.dtype).contiguous()
        return functools.partial(F.embedding, weight=dense)

    def logits(self, weight: Weight) -> LogitsHead:
        """The LM head over ``weight`` [V, H]: hidden states in ``dtype`` -> float32 logits.

        Where a bf16 model's layers run on a native kernel, the head keeps its float32 sums:
        on ``linear_avx2`` it takes its input as float32 (exactly the values the kernel
        widens bf16 to), on ``linear_bf16`` it stores the sums unrounded. Rounded to bf16,
        logits near 32 fall on steps of 0.25 (a 28% step in probability), and two tokens
        whose float32 sums differ tie, greedy then taking the lower id. Elsewhere (oneDNN,
        ``F.linear``) the layer's bf16 output is upcast.
        """
        if isinstance(weight, torch.Tensor):
            weight = self._as_blocks(weight) or weight
        quant = self._native([weight])
        if quant is not None and self.quant is not None:
            return LogitsHead(
                QuantLinear(quant, None, self.quant, io_dtype=self.dtype, float32_out=True)
            )
        weight = self._dense(weight)
        lib, q = self.library, self.quantization
        kernel = self._kernel(weight) if self.dtype == torch.bfloat16 else None
        if lib is not None and kernel == "widen":
            w = weight.to(self.device)
            return LogitsHead(WidenLinear(w, None, lib, io_dtype=torch.float32, quantization=q))
        if lib is not None and kernel == "dot":
            w = weight.to(device=self.device, dtype=torch.bfloat16).contiguous()
            return LogitsHead(Bf16DotLinear(w, None, lib, float32_out=True))
        return LogitsHead(self(weight, None))

    def _kernel(self, weight: torch.Tensor) -> str | None:
        """The native kernel a layer over ``weight`` [N, K] gets: ``dot`` (``linear_bf16``),
        ``widen`` (``linear_avx2``), or None (oneDNN or PyTorch)."""
        lib, dtype, q = self.library, self.dtype, self.quantization
        if lib is None:
            return None
        if q is not None:
            return "widen" if WidenLinear.supports(weight, dtype, q) else None
        if dtype != torch.bfloat16:
            return None
        if lib.isa in BF16_DOT_ISAS and Bf16DotLinear.supports(weight):
            return "dot"
        return "widen" if WidenLinear.supports(weight, dtype) else None

    def __call__(self, weight: Weight, bias: torch.Tensor | None) -> Linear:
        """``weight`` [N, K] in any float dtype (cast here), or in GGML blocks;
        ``bias`` [N] or None."""
        if isinstance(weight, QuantTensor):
            return self.fused([weight], bias)
        blocks = self._as_blocks(weight)
        if blocks is not None:
            return self.fused([blocks], bias)
        lib, dtype, q = self.library, self.dtype, self.quantization
        if bias is not None:
            bias = bias.to(device=self.device, dtype=dtype).contiguous()
        kernel = self._kernel(weight)
        if lib is not None and kernel == "widen":
            return WidenLinear(weight, bias, lib, io_dtype=dtype, quantization=q)
        if q is not None:
            # No kernel for these weights here: the same rounded values, dequantized once.
            block = BLOCK if q == "int8-b32" and weight.shape[1] % BLOCK == 0 else None
            weight = dequantize_int8(*quantize_int8(weight, block))
        w = weight.to(device=self.device, dtype=dtype).contiguous()
        if lib is not None and kernel == "dot":
            return Bf16DotLinear(w, bias, lib)
        if self.onednn:
            return PackedCpuLinear(w, bias)
        return TorchLinear(w, bias)
