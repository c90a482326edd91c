"""The kernel paths a test can run on this machine: every ISA level the CPU supports.

A machine with AVX512-BF16 runs the AVX2 path too (``KVGATE_CPU_ISA=avx2`` in production),
so one CI machine covers every path below its own; a path above it is not listed (skipped,
not failed: it cannot run here) and ``test_cpu_isa`` says so.
"""

from __future__ import annotations

from kvgate.model import cpu_isa


def vector_levels() -> list[str]:
    """Levels with a vector path (not ``generic``) that this CPU can run, lowest first."""
    return [lv for lv in cpu_isa.supported_levels() if lv != "generic"] or ["generic"]


def vector_path(level: str, op: str = "attention") -> str:
    """The vector path a library built for ``level`` reports (its ``kvgate_isa()``): the
    ``avx512`` level has no kernels of its own and runs the AVX2 ones; at ``amx`` only the
    linear and the block-format kernels (``quant``) have paths of their own, the other ops run
    their avx512bf16 one."""
    if level == "amx":
        return "amx" if op in ("linear", "quant") else "avx512bf16"
    return "avx512bf16" if level == "avx512bf16" else "avx2"
