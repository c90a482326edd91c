"""A DeepSeek-V3-shaped model on CPU: decode speed of ~1.3B parameters with experts against a
dense model doing the same work per token, and the KV bytes a token costs each.

Both are random-weight models built once with transformers and cached outside the repo
(``~/.cache/kvgate/bench/``), bf16, SmolLM2's tokenizer:

- ``moe``: DeepSeek-V3's layout at 1/7 of its width: hidden 1024, 12 layers (the first
  dense), 16 heads of latent attention (q rank 384, latent 256 + 32 rotary), 64 routed
  experts of 512 (6 a token, in 4 of 8 groups) and one shared expert. ~1.27B parameters,
  ~0.22B of them read per token (attention, 7 experts' MLPs, the head).
- ``dense``: a Llama of the same hidden size, depth and heads whose MLP is as wide as the
  7 experts a token uses (3584): the same multiply-adds a token, all of them dense.

Each is timed generating ``--output`` tokens after ``--prompt``-token prompts for 1 and 16
sequences (output tokens / wall time, prefill included, one warm-up first, medians of
``--repeats``). Their ratio is what the routing and the per-expert grouping cost over the
dense matmuls of the same arithmetic. KV bytes a token come from each engine's own pool
(``kv_pool.bytes / kv_pool.num_tokens``): the latent spec against plain attention.

    python bench/moe.py
    python bench/moe.py --concurrency 1 16 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvgate import LLM, SamplingParams
from kvgate.model import cpu_isa
from kvgate.model.gguf_loader import load_gguf_tokenizer
from kvgate.model.registry import resolve_model_path

CACHE = Path.home() / ".cache" / "kvgate" / "bench"
VOCAB = 49152
WIDTH: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}


def _moe_config() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **WIDTH,
        num_key_value_heads=16,
        intermediate_size=3584,
        moe_intermediate_size=512,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=1,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
    )


def _dense_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**WIDTH, num_key_value_heads=16, intermediate_size=3584)


def build(name: str) -> Path:
    """The cached model directory, built on first use."""
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM

    target = CACHE / f"moe-bench-{name}"
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    model: Any
    if name == "moe":
        model = DeepseekV3ForCausalLM(_moe_config())
    else:
        model = LlamaForCausalLM(_dense_config())
    model.to(torch.bfloat16).eval().save_pretrained(target, safe_serialization=True)
    load_gguf_tokenizer(resolve_model_path("smollm2")).save_hf(target)
    return target


def tokens_per_second(llm: LLM, n: int, prompt: int, output: int, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, VOCAB) for _ in range(prompt)] for _ in range(n)]
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == output for o in outs)
    return n * output / dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU level: {cpu_isa.default_level()}, threads: {torch.get_num_threads()}")
    rates: dict[str, dict[int, float]] = {}
    for name in ("moe", "dense"):
        directory = build(name)
        llm = LLM(str(directory), dtype="bfloat16", kv_cache_memory="1GiB", max_model_len=1024)
        engine = llm.engine
        pool = engine.kv_pool
        params = engine.model.num_parameters()
        print(
            f"{name}: {params / 1e9:.2f}B parameters, KV {pool.bytes // pool.num_tokens} bytes "
            f"a token ({engine.build_info['kv_backend']}), linear {engine.build_info['linear']}"
        )
        tokens_per_second(llm, 2, args.prompt, 4, seed=99)  # warm-up
        rates[name] = {}
        for n in args.concurrency:
            runs = [
                tokens_per_second(llm, n, args.prompt, args.output, seed=r)
                for r in range(args.repeats)
            ]
            rates[name][n] = statistics.median(runs)
            print(f"  {n:>3} sequences: {rates[name][n]:.1f} tok/s (runs {runs})")
        del llm, engine
    for n in args.concurrency:
        ratio = rates["moe"][n] / rates["dense"][n]
        print(f"{n} sequences: moe {rates['moe'][n]:.1f} / dense {rates['dense'][n]:.1f} = "
              f"{ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
