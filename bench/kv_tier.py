"""TTFT of a 4k-token document prompt: cold, pool hit, disk-tier hit after eviction, and
disk-tier hit after a restart (page cache warm, and dropped), each the median of several
documents (``--kv-tier disk``, ``engine/disk_tier.py``).

Each run takes another stretch of the Chinese legal corpus (``../shared/longdoc/corpus``),
``--prompt`` tokens long, so a cold prompt is cold. TTFT is from ``add`` to the first token,
on the synchronous engine (no HTTP). "Tier hit after eviction": the pool's cached prefixes
are dropped (``reset_prefix_cache``, what pressure from other requests does) and the same
prompt is sent again. "After restart": a new engine on the same tier folder; "cold page
cache": every tier file evicted from the OS page cache first (``posix_fadvise DONTNEED``),
so the blocks come from the disk. Load-or-recompute is the engine's own rule
(``offload.LoadCosts``), not forced.

    python bench/kv_tier.py
    python bench/kv_tier.py --model qwen2.5-coder-1.5b --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.model import cpu_isa
from kvgate.sampling_params import SamplingParams

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "longdoc" / "corpus"


def documents(engine: LLMEngine, n: int, length: int) -> list[list[int]]:
    text = "".join(p.read_text() for p in sorted(CORPUS.glob("*.md")))
    ids = engine.tokenizer.encode(text)
    if len(ids) < n * length:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than {n} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens served from a cache."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    request = engine.make_request(rid, prompt, params)
    t0 = time.perf_counter()
    engine.add(request)
    first = None
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            if out.request_id == rid and out.finished:
                cached = out.num_cached_tokens
    assert first is not None
    return first, cached


def drop_page_cache(folder: Path) -> None:
    os.sync()  # dirty pages cannot be dropped: written back first
    for path in folder.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--memory", default="2GiB")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tier-dir", default=None, help="default: a fresh temporary folder")
    args = parser.parse_args()
    tier_dir = Path(args.tier_dir or tempfile.mkdtemp(prefix="kvgate-tier-"))
    config = EngineConfig(
        model=args.model,
        kv_cache_memory=args.memory,
        max_model_len=args.prompt + 64,
        kv_tier="disk",
        kv_tier_dir=str(tier_dir),
        kv_tier_size="16GiB",
    )
    print(f"# CPU: {cpu_isa.describe_cpu()}; {args.model}, {args.prompt}-token prompts")
    engine = LLMEngine(config)
    docs = documents(engine, args.runs + 1, args.prompt - 8)
    ttft(engine, "warm-up", docs[-1])  # kernels built, caches warm
    rows: dict[str, list[tuple[float, int]]] = {}
    for i, doc in enumerate(docs[: args.runs]):
        rows.setdefault("cold", []).append(ttft(engine, f"cold-{i}", doc))
        rows.setdefault("pool hit", []).append(ttft(engine, f"pool-{i}", doc))
        assert engine.tier_io is not None
        engine.tier_io.flush()
        engine.kv_cache.pool.reset_prefix_cache()
        rows.setdefault("tier hit after eviction", []).append(ttft(engine, f"tier-{i}", doc))
    engine.close()
    del engine
    for label, drop in (
        ("tier hit after restart", False),
        ("tier hit after restart, cold page cache", True),
    ):
        engine = LLMEngine(config)
        if drop:
            drop_page_cache(tier_dir)
        for i, doc in enumerate(docs[: args.runs]):
            rows.setdefault(label, []).append(ttft(engine, f"restart-{i}", doc))
        state = engine.kv_cache.tier.state()
        engine.close()
        del engine
    cold = statistics.median(t for t, _ in rows["cold"])
    print(f"\n| {args.model}, {args.prompt} tokens | TTFT p50 (s) | of cold | cached tokens |")
    print("|---|---:|---:|---:|")
    for label, values in rows.items():
        t = statistics.median(v for v, _ in values)
        cached = statistics.median(c for _, c in values)
        print(f"| {label} | {t:.3f} | {t / cold:.1%} | {cached:.0f} |")
    c = state.counters
    print(
        f"\ntier: {state.num_blocks} blocks, {state.used_bytes / 2**20:.0f} MiB in {tier_dir}; "
        f"last engine: {c.loads} loads, {c.loaded_blocks} blocks, "
        f"{c.load_seconds / max(c.loads, 1):.3f} s a load"
    )


if __name__ == "__main__":
    main()
