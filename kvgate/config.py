"""The engine's one frozen configuration, validated with errors that name the setting."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvgate.errors import InvalidConfig

DEFAULT_MODEL = "smollm2"
_DTYPES = ("auto", "bfloat16", "float32", "float16")
_QUANTIZATIONS = (None, "int8", "int8-b32")
#: A GGUF's block-quantized matrices under dtype auto (``EngineConfig.gguf_blocks``).
GGUF_BLOCKS = ("auto", "native", "dequantize")
#: How K/V are stored (``EngineConfig.kv_cache_dtype``).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")
#: Where full KV blocks go beyond the pool (``EngineConfig.kv_tier``).
KV_TIERS = ("none", "disk")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_memory(value: str | float | int, total_bytes: int) -> int:
    """A memory budget in bytes: ``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, or a fraction in (0, 1]
    of ``total_bytes``. A bare integer above 1 is a byte count."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise InvalidConfig(
                f"kv_cache_memory must look like '2GiB', '512MiB' or a fraction like 0.3, got "
                f"{value!r}",
                param="kv_cache_memory",
            )
        number = float(m.group(1))
        if m.group(2) == "" and number <= 1.0:
            return int(number * total_bytes)
        return int(number * _UNITS[m.group(2).lower()])
    if isinstance(value, bool) or value <= 0:
        raise InvalidConfig(
            f"kv_cache_memory must be positive, got {value!r}", param="kv_cache_memory"
        )
    if value <= 1.0:
        return int(value * total_bytes)
    return int(value)


def available_memory_bytes() -> int:
    """Memory the OS reports as available (Linux MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: The EngineConfig setting of each SpeculativeConfig field it sets.
_SPEC_PARAMS = {
    "num_tokens": "num_speculative_tokens",
    "ngram_min": "speculative_ngram_min",
    "ngram_max": "speculative_ngram_max",
}
#: Methods ``--speculative`` accepts.
SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_tokens``: most draft tokens verified per step and request (k);
    ``ngram_min``/``ngram_max``: the n-gram sizes tried, longest first."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    #: Drafts a request's acceptance is judged over, and the rate below which it pauses.
    window: int = 4
    min_acceptance: float = 0.3
    #: Decode steps a low-acceptance request goes without drafts (doubling per pause, up to
    #: ``max_pause_steps``; back to ``pause_steps`` after a window at or above the rate).
    pause_steps: int = 16
    max_pause_steps: int = 512

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidConfig(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
                param="speculative",
            )
        for name in ("num_tokens", "ngram_min", "ngram_max", "window", "pause_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfig(
                    f"speculative {name} must be a positive integer, got {value!r}",
                    param=_SPEC_PARAMS.get(name, f"speculative_{name}"),
                )
        if self.ngram_min > self.ngram_max:
            raise InvalidConfig(
                f"speculative ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})",
                param="speculative_ngram_min",
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise InvalidConfig(
                f"speculative min_acceptance must be in [0, 1], got {self.min_acceptance}",
                param="speculative_min_acceptance",
            )


@dataclass(frozen=True)
class EngineConfig:
    """How to build and run one engine. Reads no files: the loader does that.

    ``kv_cache_memory``: bytes for the KV block pool, as ``"1GiB"`` or a fraction of the
    memory available at start-up (of the device's free memory on a GPU).
    ``max_num_batched_tokens``: the per-step token budget shared by decodes and prefill chunks.
    """

    model: str = DEFAULT_MODEL
    #: ``auto``: bfloat16 where a native bf16 linear exists for this CPU (or on a GPU), else
    #: float32 (``model/precision.py``).
    dtype: str = "auto"
    #: None: weights in ``dtype``; ``"int8"`` (or its synonym ``"int8-b32"``): int8 linear
    #: layers, the weights made Q8_0 blocks at load (a scale per 32 inputs; about half the
    #: bytes of bf16 per decoded token) on the W8A8 block kernels (``model/linear.py``).
    quantization: str | None = None
    #: A GGUF's block-quantized matrices (Q4_K, Q6_K, Q8_0, ...): ``auto`` keeps them in
    #: their blocks (native kernels, ``model/quant_linear.py``) under ``dtype auto`` where the
    #: model is large enough to gain (``model/precision.py``) and dequantizes them otherwise;
    #: ``native`` always keeps them (activations in ``dtype``); ``dequantize`` never.
    #: ``quantization`` always dequantizes them first.
    gguf_blocks: str = "auto"
    device: str = "cpu"
    #: How K/V are stored (``model/kv_codec.py``): ``auto`` as the model computes them;
    #: ``int8`` or ``fp8`` (e4m3) quantized with a float32 scale per 32 values of a token's
    #: KV head (about 1.8x the tokens of bf16 in the same pool); ``bfloat16`` or
    #: ``float32`` cast.
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str | float = "1GiB"
    #: A second KV tier (``engine/disk_tier.py``): ``disk`` keeps every full block the pool
    #: caches in files under ``kv_tier_dir`` (default ``$KVGATE_DATA_DIR/kv-tier``, else
    #: ``~/.local/share/kvgate/kv-tier``), up to ``kv_tier_size`` bytes, least recently used
    #: out first; a prefix the pool lost is loaded back from it, also after a restart.
    kv_tier: str = "none"
    kv_tier_size: str = "4GiB"
    kv_tier_dir: str | None = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    #: Sequences that may run beyond ``max_num_seqs``, only for requests that would otherwise
    #: preempt running work for a slot (see ``engine/scheduler.py``); None: max_num_seqs // 8,
    #: at least 1; 0: such requests always preempt.
    num_spare_seqs: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    #: Use the native CPU kernels (built on first use with the system C compiler) where they
    #: are faster; False, or no compiler, keeps everything on PyTorch ops.
    native_kernels: bool = True
    #: Speculative decoding (``engine/drafter.py``): None, or a method of
    #: ``SPECULATIVE_METHODS`` with the draft length and the n-gram sizes it tries.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    #: LoRA adapters registered at start, (name, PEFT adapter directory) each; more may be
    #: loaded while serving (``engine/lora_cache.py``). A request selects one by name.
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: Bytes of resident LoRA adapters (float32 factors), least recently used out first
    #: (never one a request in the engine uses): ``"256MiB"``, ``"1GiB"``.
    max_lora_memory: str = "256MiB"

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        return SpeculativeConfig(
            method=self.speculative,
            num_tokens=self.num_speculative_tokens,
            ngram_min=self.speculative_ngram_min,
            ngram_max=self.speculative_ngram_max,
        )

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise InvalidConfig(
                f"dtype must be one of {_DTYPES}, got {self.dtype!r}", param="dtype"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidConfig(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                param="kv_cache_dtype",
            )
        if self.kv_tier not in KV_TIERS:
            raise InvalidConfig(
                f"kv_tier must be one of {KV_TIERS}, got {self.kv_tier!r}", param="kv_tier"
            )
        if self.kv_tier != "none" and not self.enable_prefix_caching:
            raise InvalidConfig(
                "kv_tier keeps cached prefixes: it needs prefix caching (drop "
                "--no-prefix-caching or use --kv-tier none)",
                param="kv_tier",
            )
        if not isinstance(self.kv_tier_size, str) or parse_memory(self.kv_tier_size, 1) <= 1:
            raise InvalidConfig(
                f"kv_tier_size must be a size such as 8GiB, got {self.kv_tier_size!r}",
                param="kv_tier_size",
            )
        if self.gguf_blocks not in GGUF_BLOCKS:
            raise InvalidConfig(
                f"gguf_blocks must be one of {GGUF_BLOCKS}, got {self.gguf_blocks!r}",
                param="gguf_blocks",
            )
        if self.quantization not in _QUANTIZATIONS:
            raise InvalidConfig(
                f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}",
                param="quantization",
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfig(f"{name} must be a positive integer, got {value!r}", param=name)
        if self.num_spare_seqs is not None and (
            isinstance(self.num_spare_seqs, bool)
            or not isinstance(self.num_spare_seqs, int)
            or self.num_spare_seqs < 0
        ):
            raise InvalidConfig(
                f"num_spare_seqs must be a non-negative integer, got {self.num_spare_seqs!r}",
                param="num_spare_seqs",
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise InvalidConfig(
                f"max_model_len must be positive, got {self.max_model_len}", param="max_model_len"
            )
        if self.num_threads is not None and self.num_threads <= 0:
            raise InvalidConfig(
                f"num_threads must be positive, got {self.num_threads}", param="num_threads"
            )
        # Parse once now so a bad value fails at construction, not at engine start.
        parse_memory(self.kv_cache_memory, 1 << 30)
        if not isinstance(self.max_lora_memory, str) or parse_memory(self.max_lora_memory, 1) <= 1:
            raise InvalidConfig(
                f"max_lora_memory must be a size such as 256MiB, got {self.max_lora_memory!r}",
                param="max_lora_memory",
            )
        object.__setattr__(
            self, "lora_modules", tuple((str(n), str(p)) for n, p in self.lora_modules)
        )
        names = [n for n, _ in self.lora_modules]
        if len(set(names)) != len(names) or not all(names):
            raise InvalidConfig(
                f"lora_modules names must be distinct and non-empty, got {names}",
                param="lora_modules",
            )
        self.speculative_config()
