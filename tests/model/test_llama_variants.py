"""The forward pass matches HF transformers on the Llama-family variants the loader accepts:
Llama-3, linear and YaRN RoPE scaling, an untied LM head, Qwen2's q/k/v biases and Qwen3's q/k
norms."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.tokenizer import Tokenizer
from tests.gguf_writer import write_gguf
from tests.hf_reference import hf_greedy
from tests.tiny_model import TINY_LLAMA, tiny_qwen2, tiny_qwen3

VARIANTS: dict[str, dict[str, Any]] = {
    # original_max_position_embeddings=64 puts prompt positions in all three llama3 regions.
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    # YaRN (Qwen2.5's long-context setting): prompt positions before, in and past its ramp.
    "yarn-rope": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "untied-head": {"tie_word_embeddings": False},
    "qwen2-bias": {"model_type": "qwen2"},
    "qwen3-qk-norm": {"model_type": "qwen3"},
}


def _build(directory: Path, tokenizer: Tokenizer, variant: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    overrides = dict(VARIANTS[variant])
    model_type = overrides.pop("model_type", None)
    if model_type == "qwen3":
        model: Any = tiny_qwen3()
    elif model_type == "qwen2":
        model = tiny_qwen2()
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides}))
    model.eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return directory


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(
    variant: str, tmp_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    from transformers import AutoModelForCausalLM

    directory = _build(tmp_path / variant, smollm2_tokenizer, variant)
    rng = random.Random(9)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (1, 40, 300, 900)]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, max_new_tokens=8)
    llm = LLM(str(directory), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [list(o.token_ids) for o in outs] == expected


def test_qwen3_in_bfloat16_runs_the_fused_ops_and_agrees(
    tmp_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    """bf16: q/k norms between the fused projection and the fused RoPE + KV write (the
    whole-layer native decode has no q/k norm, so it stands aside)."""
    from transformers import AutoModelForCausalLM

    directory = _build(tmp_path / "qwen3", smollm2_tokenizer, "qwen3-qk-norm")
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (5, 40, 120, 300)]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, max_new_tokens=4)
    llm = LLM(str(directory), dtype="bfloat16", kv_cache_memory="64MiB")
    assert llm.engine.model.native_decode is None
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    first_agree = sum(o.token_ids[0] == e[0] for o, e in zip(outs, expected, strict=True))
    assert first_agree >= 3, (outs, expected)


# The GGUF round trip of each variant llama.cpp can store: the same weights written as
# convert_hf_to_gguf.py would, run one at a time, batched, with prefill chunked by 16 and
# with prefix-cache hits. (llama.cpp has no key for llama3 RoPE scaling but rope_freqs.)
GGUF_VARIANTS = {"untied-head": "llama", "qwen2-bias": "qwen2", "qwen3-qk-norm": "qwen3"}


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_gguf_greedy_matches_transformers(
    variant: str, tmp_path: Path, smollm2_tokenizer: Tokenizer, smollm2_gguf_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    directory = _build(tmp_path / variant, smollm2_tokenizer, variant)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    path = tmp_path / f"{variant}.gguf"
    write_gguf(
        path,
        hf,
        GGUF_VARIANTS[variant],
        smollm2_gguf_path,
        edit=lambda w: w.add_rope_freq_base(hf.config.rope_parameters["rope_theta"]),
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (1, 40, 150)]
    prompts.append(prompts[2] + prompts[1])  # a prefix hit of 144 tokens, then 40 more
    expected = hf_greedy(hf, prompts, max_new_tokens=8)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    one_at_a_time = [llm.generate([p], greedy)[0] for p in prompts]
    assert [list(o.token_ids) for o in one_at_a_time] == expected
    assert one_at_a_time[3].num_cached_tokens >= 144
    assert [list(o.token_ids) for o in llm.generate(prompts, greedy)] == expected
