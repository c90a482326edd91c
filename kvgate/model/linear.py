"""Dense layers: y = x W^T + b, with the fastest kernel this device offers for the dtype.

On an x86 CPU in bf16, oneDNN's pre-packed weights (the layout torch.compile's CPU backend
uses) run 1.5-2.7x faster than ``F.linear`` at decode batch sizes (M = 1..64) and give
bit-identical results, because ``F.linear`` re-lays out the weight on every call. Everywhere
else (fp32, where packing changes the rounding; GPUs) ``F.linear`` is used.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

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


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, pack: bool) -> Linear:
    return PackedCpuLinear(weight, bias) if pack else TorchLinear(weight, bias)


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and _packing_works(dtype)
    )
