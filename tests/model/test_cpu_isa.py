"""The ISA level: detected from the CPU, forced lower by KVGATE_CPU_ISA, refused above it;
each library reports the vector path it was compiled with."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.errors import InvalidConfig
from kvgate.model import cpu_isa
from kvgate.model.cpu_kernels import CpuKernels, build_library, load_library
from tests.model.isa import vector_levels

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
SAPPHIRE = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile"}
SKYLAKE_SP = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}

x86_only = pytest.mark.skipif(not cpu_isa.is_x86(), reason="ISA levels are x86 levels")


@x86_only
def test_levels_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)  # the CPU's best, not a forced level
    assert cpu_isa.supported_levels(frozenset()) == ("generic",)
    assert cpu_isa.supported_levels(AVX2_ONLY) == ("generic", "avx2")
    assert cpu_isa.supported_levels(SKYLAKE_SP) == ("generic", "avx2", "avx512")
    assert cpu_isa.supported_levels(SAPPHIRE) == cpu_isa.LEVELS
    assert cpu_isa.select_level(None, SAPPHIRE) == "avx512bf16"
    assert cpu_isa.select_level("avx2", SAPPHIRE) == "avx2"  # forced lower: allowed


@x86_only
def test_a_level_above_the_cpu_is_refused_naming_the_missing_flags() -> None:
    with pytest.raises(InvalidConfig) as err:
        cpu_isa.select_level("avx512bf16", AVX2_ONLY)
    assert "avx512f" in err.value.message and "avx512_bf16" in err.value.message
    assert err.value.param == "KVGATE_CPU_ISA"
    with pytest.raises(InvalidConfig, match="must be one of"):
        cpu_isa.select_level("avx9000", AVX2_ONLY)


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_each_library_reports_its_vector_path(level: str) -> None:
    if level not in cpu_isa.supported_levels():
        pytest.skip(f"this CPU cannot run {level} code (its tests run on a CPU that has it)")
    kernels = CpuKernels.probe(level)
    if level == "generic":
        # No vector path: the one fallback rule sends every op to PyTorch.
        assert kernels.paths() == dict.fromkeys(("linear", "attention", "elementwise"), "torch")
        return
    expected = "avx512bf16" if level == "avx512bf16" else "avx2"
    libraries = [load_library(name, level) for name in ("linear.c", "fused_ops.c")]
    if any(lib is None for lib in libraries):
        pytest.skip("no C compiler")
    assert kernels.paths() == dict.fromkeys(("linear", "attention", "elementwise"), expected)


def test_vector_levels_are_what_this_cpu_runs() -> None:
    assert set(vector_levels()) <= set(cpu_isa.supported_levels())


@x86_only
def test_the_cli_refuses_a_forced_level_above_the_cpu() -> None:
    above = [lv for lv in cpu_isa.LEVELS if lv not in cpu_isa.supported_levels()]
    if not above:
        pytest.skip("this CPU runs every level")
    proc = subprocess.run(
        [sys.executable, "-m", "kvgate.entrypoints.cli", "generate", "hi", "--max-tokens", "1"],
        env={"KVGATE_CPU_ISA": above[-1], "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"KVGATE_CPU_ISA={above[-1]} needs CPU flags this CPU lacks" in proc.stderr
    assert "Traceback" not in proc.stderr


@x86_only
@pytest.mark.parametrize("level", cpu_isa.LEVELS)
@pytest.mark.parametrize("source", ["linear.c", "paged_decode.c", "fused_ops.c"])
def test_every_level_compiles_here(
    level: str, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built (not loaded) for every level, so a machine without AVX-512 still catches a
    compile error in the AVX-512 paths."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVGATE_KERNEL_CACHE", str(tmp_path))
    assert build_library(source, level) is not None
