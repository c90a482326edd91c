"""Which x86 instruction-set level the native kernels are built for.

Levels, lowest first: ``generic`` (plain C, no vector path), ``avx2`` (AVX2 + FMA + F16C:
every x86-64 CPU since 2013-2015, AMD EPYC included), ``avx512`` (F/BW/VL/DQ: Skylake-SP,
Cascade Lake), ``avx512bf16`` (plus AVX512-BF16 and AVX512-VNNI: Cooper Lake, Sapphire
Rapids, Zen 4), ``amx`` (plus AMX-TILE, AMX-BF16 and AMX-INT8: Sapphire Rapids and later
Xeons; the bf16 linear and the block-format kernels run on AMX tiles, every other op as at
``avx512bf16``).

The level is the best one this CPU has, or the one ``KVGATE_CPU_ISA`` asks for: a lower
level runs a lower kernel path on a higher machine (how the tests cover every path on
whatever CPU CI has); a level above the CPU is refused here, naming the missing flags,
instead of dying of SIGILL inside a step. Each kernel library is built for one level
(``-march`` below, never ``-march=native``) and reports back, through its own
``kvgate_isa()``, which vector path it was compiled with (``cpu_kernels.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform

from kvgate.errors import InvalidConfig

LEVELS = ("generic", "avx2", "avx512", "avx512bf16", "amx")

#: /proc/cpuinfo flags each level needs (each level needs those of the levels below too).
_FLAGS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}

#: Compiler target of each level. Named CPUs rather than -march=native, so a library built
#: for a level runs on every CPU that has the level (and the cache can key on the level).
MARCH: dict[str, tuple[str, ...]] = {
    "generic": ("-march=x86-64", "-mtune=generic"),
    "avx2": ("-march=haswell", "-mtune=generic"),
    "avx512": ("-march=skylake-avx512", "-mtune=generic"),
    "avx512bf16": ("-march=cooperlake", "-mtune=generic"),
    "amx": ("-march=sapphirerapids", "-mtune=generic"),
}

ENV = "KVGATE_CPU_ISA"

#: What a forced level tells PyTorch's own CPU libraries (ATen's kernel dispatch, oneDNN), so a
#: forced level makes the whole process look like a CPU of that level, PyTorch's choices
#: included: on a Zen 4 forced to ``avx2``, oneDNN must refuse bf16 GEMMs as an AVX2-only
#: EPYC's does, or the bf16 attention and embedder paths an AVX2 CPU takes go untested.
#: MKL (float32 GEMMs: ``F.linear``, transformers in float32) is told too: on a Xeon forced to
#: ``avx2`` it otherwise kept its AVX-512 SGEMM (316 against 199 GFLOP/s on [512, 576] x
#: [576, 3072], 2 threads). It takes no AMX for float32, so the top levels leave it be.
TORCH_ENV: dict[str, dict[str, str]] = {
    "generic": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
}


def required_flags(level: str) -> tuple[str, ...]:
    """Every CPU flag ``level`` needs, its own and those of the levels below it."""
    out: list[str] = []
    for name in LEVELS[: LEVELS.index(level) + 1]:
        out.extend(_FLAGS[name])
    return tuple(out)


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def supported_levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The levels this CPU can run, lowest first (``generic`` alone off x86)."""
    if not is_x86():
        return ("generic",)
    have = cpu_flags() if flags is None else flags
    return tuple(lv for lv in LEVELS if set(required_flags(lv)) <= have)


def select_level(requested: str | None = None, flags: frozenset[str] | None = None) -> str:
    """``requested`` (or ``$KVGATE_CPU_ISA``) checked against the CPU; else the best level.

    Raises ``InvalidConfig`` for an unknown level or one this CPU cannot run.
    """
    asked = requested if requested is not None else os.environ.get(ENV) or None
    levels = supported_levels(flags)
    if asked is None:
        return levels[-1]
    if asked not in LEVELS:
        raise InvalidConfig(f"{ENV} must be one of {LEVELS}, got {asked!r}", param=ENV)
    if asked not in levels:
        have = cpu_flags() if flags is None else flags
        missing = [f for f in required_flags(asked) if f not in have] or [platform.machine()]
        raise InvalidConfig(
            f"{ENV}={asked} needs CPU flags this CPU lacks: {', '.join(missing)} "
            f"(it supports: {', '.join(levels)})",
            param=ENV,
        )
    return asked


def forced_below_best(flags: frozenset[str] | None = None) -> str | None:
    """The level ``$KVGATE_CPU_ISA`` forces when it is one this CPU runs and below its best;
    None when nothing is forced, or the value is one ``select_level`` will refuse."""
    asked = os.environ.get(ENV) or None
    levels = supported_levels(flags)
    if asked not in levels[:-1]:
        return None
    return asked


def pin_torch_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Tell PyTorch's libraries the forced level (``TORCH_ENV``), where nothing has set them.

    Called when ``kvgate`` is imported: ATen and oneDNN read these once, at their first
    kernel, so this must run before any tensor work. Returns what it set; sets nothing when
    no level is forced below the CPU's best. Child processes (the engine process, replicas)
    inherit them.
    """
    env = os.environ if environ is None else environ
    level = forced_below_best()
    if level is None:
        return {}
    added = {k: v for k, v in TORCH_ENV[level].items() if k not in env}
    env.update(added)
    return added


def lets_torch_use_bf16(level: str | None = None) -> bool:
    """Whether PyTorch's bf16 GEMMs (oneDNN) may be used at ``level``: at the CPU's own best
    level whatever it is (oneDNN alone knows, e.g. AVX-NE-CONVERT on an AVX2 CPU), and at the
    AVX-512 levels; not at a lower level forced on a higher CPU, whose oneDNN would still
    take bf16 if ``pin_torch_env`` came too late (torch already ran a kernel)."""
    lv = default_level() if level is None else level
    return lv == supported_levels()[-1] or LEVELS.index(lv) >= LEVELS.index("avx512")


@functools.cache
def default_level() -> str:
    """The level for this process: ``$KVGATE_CPU_ISA`` or the CPU's best (checked once)."""
    return select_level()


def describe_cpu() -> str:
    """The CPU's model name, cores and ISA levels, for logs and benchmark headers."""
    name = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores, ISA levels {'/'.join(supported_levels())}"
