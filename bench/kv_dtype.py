"""KV dtypes at one memory budget: tokens the pool holds, 4k-token sequences that fit, and
decode tokens/s at 32 streams, for K/V stored as the model computes them (``auto``), int8
and fp8 (``--kv-cache-dtype``, ``model/kv_codec.py``).

Each engine gets the same ``--kv-cache-memory``; capacity is the pool's own (``kv_pool``,
``blocks_for``). Speed: ``--streams`` prompts of ``--prompt`` tokens generating
``--output`` tokens each through ``LLM.generate`` (output tokens / wall time, prefill
included, one warm-up first, median of ``--repeats``).

    python bench/kv_dtype.py
    python bench/kv_dtype.py --model qwen2.5-coder-1.5b --streams 32 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvgate import LLM, SamplingParams
from kvgate.model import cpu_isa

DTYPES = ("auto", "int8", "fp8")


def run(model: str, kv: str, args: argparse.Namespace) -> dict[str, float | str]:
    llm = LLM(model, kv_cache_dtype=kv, kv_cache_memory=args.memory, max_model_len=4096)
    engine = llm.engine
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 20000) for _ in range(args.prompt)] for _ in range(args.streams)
    ]
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return {
        "kv_dtype": engine.build_info["kv_dtype"],
        "decode": engine.build_info["decode"],
        "tokens": engine.kv_pool.num_tokens,
        "seqs_4k": engine.kv_pool.num_blocks // engine.blocks_for(4096),
        "tok_s": statistics.median(rates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--memory", default="1GiB")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# CPU: {cpu_isa.describe_cpu()}; {args.model}, --kv-cache-memory {args.memory}")
    rows = {kv: run(args.model, kv, args) for kv in DTYPES}
    base = rows["auto"]
    print("| --kv-cache-dtype | stored as | decode path | tokens in the pool | 4k-token "
          f"sequences | {args.streams} streams tok/s | vs auto |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|")
    for kv, r in rows.items():
        ratio = float(r["tok_s"]) / float(base["tok_s"])
        print(
            f"| {kv} | {r['kv_dtype']} | {r['decode']} | {int(r['tokens']):,} | "
            f"{r['seqs_4k']} | {float(r['tok_s']):.1f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
