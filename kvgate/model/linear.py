"""Dense layers: y = x W^T + b, with the fastest kernel this device offers for the dtype.

On an x86 CPU with AVX512-BF16, in bf16: ``NativeCpuLinear`` (``csrc/linear_bf16.c``), with
the weight packed once at load time into panels of 32 output columns in which each pair of
input features sits side by side, the layout vdpbf16ps multiplies. It streams each panel
once for all rows of x; measured against oneDNN's pre-packed linear on SmolLM2's layers
(2 threads): 1.55x at 1 row, 1.23x at 32 and 64, equal from 512 rows up. Each output is one
float32 sum in a fixed order whatever the batch holds, so a sequence's logits never depend
on what it is batched with. Against ``F.linear`` it differs by one bf16 ulp in a few outputs
in ten thousand (a different summation order).

Where that is not compiled in (no AVX512-BF16, or shapes it does not take): oneDNN's
pre-packed weights (1.5-2.7x faster than ``F.linear`` at decode sizes, bit-identical, since
``F.linear`` re-lays out the weight on every call). Everywhere else (fp32, where packing
changes the rounding; GPUs) ``F.linear`` is used.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from kvgate.model.cpu_kernels import load_linear_lib

log = logging.getLogger("kvgate.model")


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        ...


class TorchLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedCpuLinear:
    """oneDNN linear over a weight re-laid out once at load time (CPU, bf16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


class NativeCpuLinear:
    """``csrc/linear_bf16.c`` over a weight packed once: [N / 32, K / 2, 32, 2] (bf16, CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        # panel p, feature pair j, column c, member i = W[32 p + c, 2 j + i]
        self.packed = weight.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self._fn = lib.linear_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return n % 32 == 0 and k % 2 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.out_features), dtype=x.dtype, device=x.device)
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


def _packing_works(dtype: torch.dtype) -> bool:
    """Probe the private oneDNN ops once: present, and equal to F.linear on a small case."""
    try:
        w = torch.randn(48, 32).to(dtype)
        x = torch.randn(5, 32).to(dtype)
        got = PackedCpuLinear(w)(x)
        return bool(torch.equal(got, F.linear(x, w)))
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool, native: bool = True
) -> Linear:
    """``pack``: a bf16 weight on an x86 CPU (``should_pack``); ``native``: the compiled
    kernel may be used for it (``EngineConfig.native_kernels``)."""
    if not pack:
        return TorchLinear(weight, bias)
    lib = load_linear_lib() if native else None
    if lib is not None and NativeCpuLinear.supports(weight):
        return NativeCpuLinear(weight, bias, lib)
    return PackedCpuLinear(weight, bias)


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and _packing_works(dtype)
    )
