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


#: Below how many bytes of weights in bf16 ``dtype auto`` dequantizes a GGUF's blocks at load
#: instead of multiplying them natively, per (the block kernels' path, the bf16 linear's path)
#: of this process (``CpuKernels.paths()``); pairs not listed take ``NATIVE_BLOCKS_MIN_BYTES``.
#: Measured with bench/throughput.py (--gguf-blocks native against auto's bf16), 2 cores:
#:
#: - VNNI blocks beside the AVX-512 bf16 linear (AMD EPYC Zen 4, 2026-12-04, after the
#:   two-blocks-per-load panels; a noisy VM, runs alternated): SmolLM2-135M Q4_1 batch-1 decode
#:   110-176 tok/s native against 80-117 in bf16; 32 sequences a tie or better, medians 386
#:   against 380 (six and five runs), in 97 MB of weights read instead of 269. So every size
#:   goes native there (a day earlier, before those panels, bf16 led: 101 vs 74, 333 vs 292).
#: - The AVX2 blocks beside the AVX2 bf16 linear (the same Zen 4 forced to avx2, same day):
#:   bf16 leads, 87 against 60 tok/s at batch 1, 186 against 112 at 32 sequences.
#: - The AMX int8 blocks beside the AMX bf16 linear (a Xeon with AMX, 2026-12-05, the blocks
#:   on tiles from 16 rows): SmolLM2 batch-1 decode 207 tok/s native against 94 in bf16, but
#:   32 sequences 537-547 against 634-645 (two runs each, alternated): bf16's tiles multiply
#:   many rows faster than the int8 tiles, whose float32 steps per group bound them. Not a win
#:   at both, so small models stay bf16 there.
#: - Qwen2.5-Coder-1.5B Q4_K_M (3.1 GB in bf16) is native on every path: on the Zen 4 its
#:   batch-1 decode was within 4% of bf16 before the one-row kernels (10.6 against 11.0 tok/s)
#:   and 23.0 after, in a third of the memory and a tenth of the start-up; hence 1 GiB.
NATIVE_BLOCKS_MIN_BYTES = 1 << 30
NATIVE_BLOCKS_MIN_BYTES_BY_PATH: dict[tuple[str, str], int] = {
    ("avx512bf16", "avx512bf16"): 0,
}


def native_blocks_min_bytes(paths: Mapping[str, str]) -> int:
    """The size from which ``dtype auto`` keeps blocks native, for ``CpuKernels.paths()``."""
    key = (paths.get("quant", "torch"), paths.get("linear", "torch"))
    return NATIVE_BLOCKS_MIN_BYTES_BY_PATH.get(key, NATIVE_BLOCKS_MIN_BYTES)


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
            f"{min_bytes / 2**20:.0f} MiB, where bf16 kernels are faster on this CPU"
        )
    return True, f"{types} blocks kept native ({bf16 / 2**20:.0f} MiB in bf16 would be read)"


def dequantized(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """``weights`` with every block-quantized matrix dequantized to float32: what
    ``load_checkpoint`` without ``keep_quantized`` gives."""
    return {k: w.dequantize() if isinstance(w, QuantTensor) else w for k, w in weights.items()}
