"""KV bytes a token really costs, from the pool's own accounting, for three models of one
width: DeepSeek-V4's window plus compressed entries, DeepSeek-V3's latent vector, and plain
grouped-query attention.

Random-weight models built once with transformers and cached outside the repo
(``~/.cache/kvgate/bench/``), bf16, SmolLM2's tokenizer, all of hidden 1024 and 8 layers:

- ``v4``: DeepSeek-V4-Flash's attention at its real sizes (one KV head of 512 with 64 rotary
  dims, 16 heads, a 128-token window, sparse layers compressing 4 tokens into one entry with
  an indexer of 128 dims, heavily compressed layers 128 into one), its layer pattern (two
  heavily compressed, then alternating), and small experts (the MLPs do not touch the KV).
- ``v3``: DeepSeek-V3's latent attention at 1/7 of its width (latent 256 + 32 rotary), as
  ``bench/moe.py`` builds it.
- ``gqa``: a Llama with 16 heads of 64 sharing 4 KV heads.

For each model and prompt length, one request is prefilled and the engine's snapshot read
while it decodes: ``kv_held_bytes_per_token`` (``kvgate:kv_cache_held_bytes_per_token``),
the bytes of the blocks it holds over the tokens of its context, block rounding included.

    python bench/kv_bytes.py
    python bench/kv_bytes.py --lengths 1024 8192
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import torch

from kvgate import LLM, SamplingParams
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.model import cpu_isa
from kvgate.model.gguf_loader import load_gguf_tokenizer
from kvgate.model.registry import resolve_model_path

CACHE = Path.home() / ".cache" / "kvgate" / "bench"
VOCAB = 49152
LAYERS = 8
WIDTH: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 1024,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 16,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
}
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _config(name: str) -> Any:
    if name == "v4":
        from transformers import DeepseekV4Config

        return DeepseekV4Config(
            **WIDTH,
            head_dim=512,
            qk_rope_head_dim=64,
            q_lora_rank=512,
            o_groups=4,
            o_lora_rank=256,
            sliding_window=128,
            compress_rates={CSA: 4, HCA: 128},
            layer_types=[HCA, HCA] + [CSA if i % 2 else HCA for i in range(LAYERS - 2)],
            mlp_layer_types=["hash_moe"] + ["moe"] * (LAYERS - 1),
            index_n_heads=16,
            index_head_dim=128,
            index_topk=512,
            hc_mult=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
        )
    if name == "v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **WIDTH,
            num_key_value_heads=16,
            intermediate_size=1024,
            moe_intermediate_size=256,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
        )
    from transformers import LlamaConfig

    return LlamaConfig(**WIDTH, num_key_value_heads=4, intermediate_size=2048)


def _build(name: str) -> Path:
    directory = CACHE / f"kv-bytes-{name}"
    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.bfloat16)
    if name == "v4":  # distinct experts for each token id in the hash-routed layer
        with torch.no_grad():
            gate = model.model.layers[0].mlp.gate
            gate.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(VOCAB)]))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    load_gguf_tokenizer(resolve_model_path("smollm2")).save_hf(directory)
    return directory


def measure(name: str, lengths: list[int]) -> list[tuple[int, float, str]]:
    """(prompt length, held bytes a token, KV backend) per length."""
    llm = LLM(str(_build(name)), dtype="bfloat16", kv_cache_memory="4GiB", max_model_len=32768)
    engine = llm.engine
    rng = random.Random(1)
    out = []
    for n in lengths:
        prompt = [rng.randrange(100, VOCAB) for _ in range(n)]
        engine.add_request(f"{name}-{n}", prompt, SamplingParams(max_tokens=2, temperature=0.0))
        held = 0.0
        while engine.has_unfinished():
            engine.step()
            if any(r.num_computed_tokens >= n for r in engine.scheduler.running):
                held = EngineSnapshot.capture(engine).kv_held_bytes_per_token
        out.append((n, held, engine.build_info["kv_backend"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--models", nargs="+", default=["gqa", "v3", "v4"])
    args = parser.parse_args()
    print(f"# CPU: {cpu_isa.describe_cpu()}")
    rows = {name: measure(name, args.lengths) for name in args.models}
    base = dict((n, held) for n, held, _ in rows.get("gqa", []))
    print("| model | KV backend | prompt tokens | bytes a token | vs gqa |")
    print("|---|---|---:|---:|---:|")
    for name, results in rows.items():
        for n, held, backend in results:
            ratio = f"{base[n] / held:.1f}x less" if n in base and held and name != "gqa" else ""
            print(f"| {name} | {backend} | {n} | {held:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
