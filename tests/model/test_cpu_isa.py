"""The ISA level: detected from the CPU, forced lower by KVGATE_CPU_ISA, refused above it;
each library reports the vector path it was compiled with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgate.errors import InvalidConfig
from kvgate.model import cpu_isa
from kvgate.model.cpu_kernels import CpuKernels, build_library, load_library
from tests.model.isa import vector_levels, vector_path

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
SKYLAKE_SP = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
COOPER_LAKE = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni"}  # Zen 4 too
SAPPHIRE = COOPER_LAKE | {"amx_tile", "amx_bf16", "amx_int8"}

CSRC = Path(cpu_isa.__file__).parent / "csrc"  # every kernel source
x86_only = pytest.mark.skipif(not cpu_isa.is_x86(), reason="ISA levels are x86 levels")


@x86_only
def test_levels_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)  # the CPU's best, not a forced level
    assert cpu_isa.supported_levels(frozenset()) == ("generic",)
    assert cpu_isa.supported_levels(AVX2_ONLY) == ("generic", "avx2")
    assert cpu_isa.supported_levels(SKYLAKE_SP) == ("generic", "avx2", "avx512")
    assert cpu_isa.supported_levels(SAPPHIRE) == cpu_isa.LEVELS
    assert cpu_isa.select_level(None, SAPPHIRE) == "amx"
    assert cpu_isa.select_level(None, COOPER_LAKE) == "avx512bf16"
    assert cpu_isa.select_level("avx512bf16", SAPPHIRE) == "avx512bf16"
    assert cpu_isa.select_level("avx2", SAPPHIRE) == "avx2"  # forced lower: allowed
    # bf16 without VNNI (no such CPU shipped): the int8 kernels of that level need both
    assert cpu_isa.supported_levels(SAPPHIRE - {"avx512_vnni"})[-1] == "avx512"


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
        ops = ("linear", "attention", "elementwise", "quant")
        assert kernels.paths() == dict.fromkeys(ops, "torch")
        return
    libraries = [load_library(name, level) for name in ("linear.c", "fused_ops.c")]
    if any(lib is None for lib in libraries):
        pytest.skip("no C compiler")
    assert kernels.paths() == {op: vector_path(level, op) for op in kernels.paths()}


def test_vector_levels_are_what_this_cpu_runs() -> None:
    assert set(vector_levels()) <= set(cpu_isa.supported_levels())


@pytest.mark.slow
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


@pytest.mark.slow
@x86_only
@pytest.mark.parametrize("level", cpu_isa.LEVELS)
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
def test_every_level_compiles_here(
    level: str, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built (not loaded) for every level, so a machine without AVX-512 still catches a
    compile error in the AVX-512 paths."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVGATE_KERNEL_CACHE", str(tmp_path))
    assert build_library(source, level) is not None


def test_a_forced_level_is_pinned_for_torch_too(monkeypatch: pytest.MonkeyPatch) -> None:
    levels = cpu_isa.supported_levels()
    if len(levels) < 2:
        pytest.skip("one level only here: nothing can be forced below it")
    monkeypatch.setenv(cpu_isa.ENV, levels[0])
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # set by the user: kept
    assert cpu_isa.pin_torch_env(env) == {
        k: v for k, v in cpu_isa.TORCH_ENV[levels[0]].items() if k != "ONEDNN_MAX_CPU_ISA"
    }
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    for not_forced in (levels[-1], "avx9000", ""):  # the best level, a bad value, unset
        monkeypatch.setenv(cpu_isa.ENV, not_forced)
        assert cpu_isa.pin_torch_env({}) == {}


def test_torch_bf16_is_allowed_at_the_best_level_and_the_avx512_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_isa, "supported_levels", lambda flags=None: cpu_isa.LEVELS)
    assert [cpu_isa.lets_torch_use_bf16(lv) for lv in cpu_isa.LEVELS] == [
        False,
        False,
        True,
        True,
        True,
    ]
    # An AVX2 CPU's own best level: oneDNN alone decides (AVX-NE-CONVERT CPUs have bf16).
    monkeypatch.setattr(cpu_isa, "supported_levels", lambda flags=None: ("generic", "avx2"))
    assert cpu_isa.lets_torch_use_bf16("avx2")


@pytest.mark.slow
@x86_only
def test_a_process_forced_to_a_lower_level_sees_torch_at_that_level() -> None:
    """``import kvgate`` first, as the CLI and the engine process do: ATen dispatches to the
    forced level's kernels and oneDNN takes no bf16 GEMM below AVX-512."""
    levels = cpu_isa.supported_levels()
    lower = "avx2" if "avx512" in levels else "generic"
    if lower == levels[-1]:
        pytest.skip("one level only here: nothing can be forced below it")
    env = {k: v for k, v in os.environ.items() if k not in cpu_isa.TORCH_ENV[lower]}
    env[cpu_isa.ENV] = lower
    env["MKL_VERBOSE"] = "1"  # MKL names the instruction set it runs at its first call
    code = (
        "import kvgate, torch\n"
        "from kvgate.model.cpu_kernels import torch_bf16_gemm\n"
        "x = torch.randn(64, 64)\n"
        "x @ x\n"
        "print(torch.backends.cpu.get_cpu_capability(), torch_bf16_gemm(),"
        " torch.ops.mkldnn._is_mkldnn_bf16_supported())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    capability, ours, onednn = out.stdout.strip().splitlines()[-1].split()
    assert capability == cpu_isa.TORCH_ENV[lower]["ATEN_CPU_CAPABILITY"].upper()
    assert (ours, onednn) == ("False", "False")
    # float32 GEMMs at the forced level too. MKL names its instruction set on Intel CPUs
    # only: on AMD's it says "Intel(R) Architecture processors" whatever it is allowed.
    if torch.backends.mkl.is_available() and "Architecture processors" not in out.stdout:
        mkl = {"avx2": "(Intel(R) AVX2) enabled", "generic": "(Intel(R) SSE4.2) enabled"}
        assert mkl[lower] in out.stdout, out.stdout[:300]
