"""Greedy output of the engine is token-identical to HF transformers on the same weights.

A tiny random-weight Llama in fp32: one prompt at a time, all in one batch, with the chunked
prefill budget forced to 16 tokens, and again on a warm prefix cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.model.cpu_kernels import CpuKernels
from tests.hf_reference import hf_greedy

PROMPT_LENGTHS = [1, 2, 15, 16, 17, 100, 333, 1100]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    # Ids above the special tokens, so no prompt contains EOS.
    return [[rng.randrange(100, 49152) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_outputs(tiny_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return hf_greedy(model, prompts, MAX_NEW)


def _llm(tiny_dir: Path, **kw: object) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory="64MiB", **kw)  # type: ignore[arg-type]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def test_one_at_a_time(
    tiny_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    llm = _llm(tiny_dir, enable_prefix_caching=False)
    for p, ref in zip(prompts, hf_outputs, strict=True):
        (out,) = llm.generate([p], GREEDY)
        assert list(out.token_ids) == ref, f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("native_kernels", [True, False])
def test_all_in_one_batch(
    tiny_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]], native_kernels: bool
) -> None:
    llm = _llm(
        tiny_dir,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        native_kernels=native_kernels,
    )
    # The kernel is used exactly when asked for and this machine's level has a vector path
    # (KVGATE_CPU_ISA=generic, or no compiler: PyTorch throughout).
    has_kernel = CpuKernels.probe().attention is not None
    assert (llm.engine.model.attention.decode_kernel is not None) == (native_kernels and has_kernel)
    outs = llm.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outs] == hf_outputs


def test_chunked_prefill_budget_16(
    tiny_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    llm = _llm(tiny_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outs] == hf_outputs


def test_second_run_hits_prefix_cache(
    tiny_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    llm = _llm(tiny_dir, max_num_batched_tokens=256)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in first] == hf_outputs
    assert [list(o.token_ids) for o in second] == hf_outputs
    assert all(o.num_cached_tokens == 0 for o in first)
    # Every full block of each prompt except the block holding its last token is reused.
    block = 16
    expected = [((len(p) - 1) // block) * block for p in prompts]
    assert [o.num_cached_tokens for o in second] == expected
    assert sum(expected) > 1000


def test_small_kv_pool_forces_preemption_and_stays_exact(
    tiny_dir: Path, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    # Room for ~1.3 max-length sequences: concurrent prompts must preempt and recompute.
    llm = LLM(
        str(tiny_dir),
        dtype="float32",
        # KV per token: 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 4 bytes = 512 B.
        kv_cache_memory=str(84 * 16 * 512),  # 84 blocks of 16 tokens
        max_model_len=1200,
        max_num_batched_tokens=512,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [list(o.token_ids) for o in outs] == hf_outputs
