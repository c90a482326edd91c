"""The shipped real model, Qwen2.5-Coder-1.5B-Instruct Q4_K_M, on its native quantized path
(weights in their GGUF blocks, int8 activations: ``quant_linear.py``) against the same file
dequantized to float32 (``--dtype float32``): perplexity on fixed public texts, English and
Chinese, within 1%; greedy agreement on fixed chat prompts (reported, and bounded below); a
Chinese legal question answered as the dequantized model answers it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.errors import ModelNotFound
from kvgate.model.registry import resolve_model_path
from tests.e2e.perplexity import perplexity

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1]
#: The Apache License 2.0 (Debian's copy) and an excerpt of the Civil Code of the PRC: fixed
#: public texts, English and Chinese.
TEXTS = {
    "en": DATA / "e2e" / "data" / "apache-2.0.txt",
    "zh": DATA / "data" / "zh_civil_code_excerpt.txt",
}
WINDOW = 512  # tokens per forward pass; each window starts fresh
MAX_TOKENS = 1024  # of each text
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "劳动合同期限三年以上的，试用期最长不得超过多久？",
    "请用一句话解释什么是机器学习。",
    "中华人民共和国的首都是哪里？",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    try:
        return resolve_model_path("qwen2.5-coder-1.5b")
    except ModelNotFound as exc:
        pytest.fail(f"the shipped Qwen model is part of the install: {exc.message}")


def _llm(path: Path, dtype: str) -> LLM:
    return LLM(str(path), dtype=dtype, kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(scope="module")
def engines(qwen_path: Path) -> Iterator[tuple[LLM, LLM]]:
    native = _llm(qwen_path, "auto")
    if "Q4_K" not in native.engine.build_info["linear"]:
        linear = native.engine.build_info["linear"]
        pytest.skip(f"no native block kernels on this machine ({linear})")
    reference = _llm(qwen_path, "float32")
    yield native, reference


@pytest.mark.parametrize("lang", sorted(TEXTS))
def test_perplexity_within_one_percent_of_float32(engines: tuple[LLM, LLM], lang: str) -> None:
    native, reference = engines
    ids = native.tokenizer.encode(TEXTS[lang].read_text(encoding="utf-8"))[:MAX_TOKENS]
    assert len(ids) > 600
    ppl_ref = perplexity(reference.engine, ids, WINDOW)
    assert 1 < ppl_ref < 30  # the model reads the text: a broken forward would be ~10^5
    linear = native.engine.build_info["linear"]
    # prompt tokens' products, and where those differ (bf16 tiles on AMX) generated tokens'
    # measured: AMD EPYC Zen 4 (VNNI, 2026-12-03) en +0.35%, zh +0.47%; Xeon with AMX
    # (2026-12-05) bf16 tiles en -0.83%, zh +0.91%, the int8 products +0.23%, +0.38%
    for as_prompt in (True, False) if native.engine.model.prompt_tiles else (True,):
        ppl_native = perplexity(native.engine, ids, WINDOW, as_prompt)
        change = ppl_native / ppl_ref - 1
        print(f"\n{lang}: {len(ids)} tokens, perplexity float32 {ppl_ref:.4f}, native {linear} "
              f"{ppl_native:.4f} ({change * 100:+.3f}%, as prompt: {as_prompt})")  # fmt: skip
        assert abs(change) < 0.01


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]  # type: ignore[arg-type]


#: The fewest leading tokens any prompt's greedy answer must share with float32's. int8
#: activations move logits by ~1e-3 relative, so a near tie can flip a token; a flip in the
#: first 8 tokens of these short factual answers would mean an error well beyond that.
MIN_AGREEMENT = 8


def test_greedy_agrees_with_float32(engines: tuple[LLM, LLM]) -> None:
    native, reference = engines
    tok = native.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in PROMPTS
    ]
    ours, ref = _greedy(native, prompts), _greedy(reference, prompts)
    lengths = []
    for a, b in zip(ours, ref, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        lengths.append(same)
    # measured 2026-12-03 (AMD EPYC Zen 4, VNNI): [32, 32, 32, 21, 32, 32]
    print(f"\ngreedy agreement with float32 (tokens of {MAX_NEW}): {lengths}")
    assert min(lengths) >= MIN_AGREEMENT
    # the legal question: the answer the dequantized model gives (six months)
    assert "六个月" in tok.decode(
        ours[PROMPTS.index("劳动合同期限三年以上的，试用期最长不得超过多久？")]
    )
