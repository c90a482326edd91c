"""``dtype="auto"``: the compute dtype that is fast on this device.

On a CPU, bf16 halves the bytes a decode step reads (decode is bound by memory bandwidth), but
only a native bf16 linear makes it fast: without one (no AVX2 path built, and oneDNN refusing
bf16 weights, as on CPUs without AVX512BW), ``F.linear`` in bf16 is several times slower than
in float32 (measured on an AVX2-only AMD EPYC before the AVX2 kernels: 17.5 vs 91.6 output
tok/s at 32 streams), so float32 is chosen there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvgate.model.cpu_kernels import CpuKernels, torch_bf16_gemm
from kvgate.model.linear import LinearFactory, Weight
from kvgate.model.quant_tensor import QuantTensor

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


#: Below this many bytes of weights in bf16, ``dtype auto`` dequantizes a GGUF's blocks at load
#: instead of multiplying them natively. Measured 2026-12-03 on an AMD EPYC Zen 4 (2 cores,
#: AVX512-VNNI, bench/throughput.py): SmolLM2-135M Q4_1 (270 MB in bf16) decodes at 74 tok/s
#: native against 101 in bf16 at batch 1, 292 against 333 at 32 sequences (a small model's
#: bf16 weights stream fast enough, and vdpbf16ps multiplies them faster than the blocks
#: decode); Qwen2.5-Coder-1.5B Q4_K_M (3.1 GB in bf16) 10.6 against 11.0 at batch 1, in a
#: third of the memory and a tenth of the start-up.
NATIVE_BLOCKS_MIN_BYTES = 1 << 30


def native_blocks(
    weights: Mapping[str, Weight], min_bytes: int = NATIVE_BLOCKS_MIN_BYTES
) -> tuple[bool, str]:
    """(whether ``dtype auto`` keeps a checkpoint's block-quantized matrices in their blocks,
    why), from the weights as ``load_checkpoint(keep_quantized=True)`` gave them: when they
    would be at least ``min_bytes`` in bf16."""
    blocks = [w for w in weights.values() if isinstance(w, QuantTensor)]
    if not blocks:
        return False, "no block-quantized matrices"
    types = "+".join(sorted({w.qtype.name for w in blocks}))
    bf16 = 2 * sum(w.numel() for w in blocks)
    if bf16 < min_bytes:
        return False, (
            f"{types} blocks dequantized: {bf16 / 2**20:.0f} MiB in bf16 is under "
            f"{min_bytes / 2**20:.0f} MiB, where bf16 kernels are faster"
        )
    return True, f"{types} blocks kept native ({bf16 / 2**20:.0f} MiB in bf16 would be read)"


def dequantized(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """``weights`` with every block-quantized matrix dequantized to float32: what
    ``load_checkpoint`` without ``keep_quantized`` gives."""
    return {k: w.dequantize() if isinstance(w, QuantTensor) else w for k, w in weights.items()}
