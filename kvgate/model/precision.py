"""``dtype="auto"``: the compute dtype that is fast on this device.

On a CPU, bf16 halves the bytes a decode step reads (decode is bound by memory bandwidth), but
only a native bf16 linear makes it fast: without one (no AVX2 path built, and oneDNN refusing
bf16 weights, as on CPUs without AVX512BW), ``F.linear`` in bf16 is several times slower than
in float32 (measured on an AVX2-only AMD EPYC before the AVX2 kernels: 17.5 vs 91.6 output
tok/s at 32 streams), so float32 is chosen there.
"""

from __future__ import annotations

import torch

from kvgate.model.cpu_kernels import CpuKernels, torch_bf16_gemm
from kvgate.model.linear import LinearFactory

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device, kernels: CpuKernels) -> tuple[torch.dtype, str]:
    """(dtype, why) for ``EngineConfig.dtype``: a named dtype as asked, or ``auto``'s pick."""
    if name != "auto":
        return DTYPES[name], "asked for"
    if device.type != "cpu":
        return torch.bfloat16, f"auto on {device.type}"
    factory = LinearFactory.for_device(torch.bfloat16, device, kernels.linear)
    if factory.path != "torch-bfloat16":
        return torch.bfloat16, f"auto: native bf16 linear ({factory.path})"
    return torch.float32, "auto: no native bf16 linear on this CPU, float32 is faster"


def upcast_attention(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 attention matmuls should run in float32 here: on CPUs where PyTorch has no
    fast bf16 matmul (oneDNN needs AVX512-BF16 or AMX for it; without, bf16 matmuls fall
    back to a path ~10x slower than float32)."""
    return dtype == torch.bfloat16 and device.type == "cpu" and not torch_bf16_gemm()
