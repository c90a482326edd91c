"""``kvgate plan`` against the real allocation: for every shipped model installed here and
every KV dtype, the plan at one ``--memory`` (weights, KV bytes a token and a block, pool
blocks, sequences of ``--max-model-len`` that fit), then an engine built with the plan's
``--kv-cache-memory`` and the same figures read off it (``launch.plan.allocation``: the
model's tensors walked, each storage once; the KV tensors allocated; ``blocks_for``). Then
the weights in other formats, each planned for a 256 MiB pool inside the memory its plan
says that needs.

The plans take this process's size once, at start (before any model is loaded), so every
model is planned as a fresh server would be.

    python bench/plan_check.py
    python bench/plan_check.py --memory 8GiB --max-model-len 8192 --out table.md
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from pathlib import Path

from kvgate.config import KV_CACHE_DTYPES, EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.errors import ModelNotFound
from kvgate.launch.plan import allocation, plan_for, resident_bytes
from kvgate.model import cpu_isa
from kvgate.model.registry import resolve_model_path

MODELS = ("smollm2", "gemma3-270m", "qwen2.5-coder-1.5b")
#: Weight formats checked beside --dtype auto.
VARIANTS: dict[str, list[dict[str, str]]] = {
    "smollm2": [{"dtype": "float32"}, {"quantization": "int8"}, {"gguf_blocks": "native"}],
    "gemma3-270m": [{"dtype": "float32"}, {"gguf_blocks": "native"}],
    "qwen2.5-coder-1.5b": [{"gguf_blocks": "dequantize"}],
}
HEAD = (
    "| model | settings | KV dtype | linear | weights MiB plan / real | off | "
    "KV B/token plan / real | block B plan / real | pool blocks plan / real | "
    "seqs plan / real | --kv-cache-memory | build s |\n"
    "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def check(config: EngineConfig, memory: str | None, process: int) -> str:
    """One markdown row: the plan, the engine built from it, their figures."""
    if memory is None:  # the memory a 256 MiB pool needs, by the plan itself
        sized = plan_for(
            dataclasses.replace(config, kv_cache_memory="256MiB"), process_bytes=process
        )
        memory = str(sized.memory)
    plan = plan_for(config, memory=memory, process_bytes=process)
    (kv,) = plan.kv
    t0 = time.perf_counter()
    engine = LLMEngine(dataclasses.replace(config, kv_cache_memory=plan.kv_cache_memory))
    build = time.perf_counter() - t0
    got = allocation(engine)
    w, real = plan.weights.total, got.weight_bytes
    settings = {"dtype": "auto", "quantization": None, "gguf_blocks": "auto"}
    shown = [f"{k}={getattr(config, k)}" for k, v in settings.items() if getattr(config, k) != v]
    row = [
        config.model,
        ", ".join(shown) or "auto",
        engine.build_info["kv_dtype"] + (" (auto)" if config.kv_cache_dtype == "auto" else ""),
        engine.build_info["linear"],
        f"{w / 2**20:,.2f} / {real / 2**20:,.2f}",
        f"{(w / real - 1) * 100:+.4f}%",
        f"{kv.bytes_per_token:,} / {got.bytes_per_token:,}",
        f"{kv.block_bytes:,} / {got.block_bytes:,}",
        f"{kv.num_blocks:,} / {got.num_blocks:,}",
        f"{kv.sequences} / {got.num_blocks // got.seq_blocks}",
        plan.kv_cache_memory,
        f"{build:.1f}",
    ]
    del engine
    gc.collect()
    return "| " + " | ".join(row) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="4GiB", help="the server's whole memory")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    process = resident_bytes()
    out: list[str] = []

    def say(line: str) -> None:
        out.append(line)
        print(line, flush=True)

    say(f"CPU: {cpu_isa.describe_cpu()}; process {process / 2**20:.0f} MiB before any model")
    say("")
    say(f"Every KV dtype at --memory {args.memory}, --max-model-len {args.max_model_len}:")
    say("")
    say(HEAD)
    installed = []
    for model in MODELS:
        try:
            resolve_model_path(model)
        except ModelNotFound as exc:
            say(f"| {model} | not installed: {exc.message} |")
            continue
        installed.append(model)
        for kv in KV_CACHE_DTYPES:
            config = EngineConfig(model=model, max_model_len=args.max_model_len, kv_cache_dtype=kv)
            say(check(config, args.memory, process))
    say("")
    say("Weights in other formats, each with a 256 MiB pool in the memory its plan gives:")
    say("")
    say(HEAD)
    for model in installed:
        for settings in VARIANTS.get(model, []):
            config = EngineConfig(model=model, max_model_len=args.max_model_len, **settings)  # type: ignore[arg-type]
            say(check(config, None, process))
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
