"""Needles in a haystack with quantized KV (``--kv-cache-dtype int8`` / ``fp8``): the model
finds numbers hidden in a long text as often as with K/V stored as it computes them (but
fp8 on SmolLM2 at 8k, which misses one more: ``MAY_MISS``).

SmolLM2-135M-Instruct at its longest context (8192 tokens: prompt and answer): a haystack
of the Apache License 2.0, repeated, with five needles at 10/30/50/70/90% of it, each a
4-digit number of its own kind (``The locker number is 3201.``), each asked for in its own
chat turn, greedy (``bench/kv_needle.py``, which builds and scores them, and measures more
lengths and haystacks). A 135M model misses some needles at 8k even with bf16 K/V (73% over
three haystacks, ``bench/results/2026-12-07-intel-xeon-amx-kv-needle.md``); this haystack
(seed 1) is one whose five it finds with bf16, so a quantized cache that loses a needle
fails here, and bf16 must find at least four for the comparison to mean anything.

Qwen2.5-Coder-1.5B (the shipped GGUF) at 2048 tokens, to keep the module within a few
minutes on two cores (its context is 32k: ``bench/kv_needle.py`` runs it longer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from bench.kv_needle import MAX_NEW, ask, found, haystack, needle_llm
from kvgate.errors import ModelNotFound
from kvgate.model.registry import resolve_model_path

pytestmark = pytest.mark.slow

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: Needles a quantized cache may miss beyond bf16's, where measured so: fp8 (e4m3) on
#: SmolLM2 at 8k misses one that bf16 finds, here and over three haystacks of the bench
#: (12/15 against 13/15; int8 13/15). SmolLM2 has no key bias, so ``kv_codec.key_offset``
#: has nothing to take out: this is e4m3's 3-bit mantissa on a 135M model at its longest
#: context (int8 is the KV dtype to use there).
MAY_MISS = {("smollm2", "fp8"): 1}
#: model -> (context length to fill, haystack seed)
SETUPS = {"smollm2": (8192, 1), "qwen2.5-coder-1.5b": (2048, 0)}

Found = Callable[[str, str], list[bool]]


def _found(model: str, kv: str) -> list[bool]:
    """Which of the haystack's needles the model finds with ``kv`` K/V, by depth."""
    length, seed = SETUPS[model]
    try:
        path = resolve_model_path(model)
    except ModelNotFound as exc:
        pytest.fail(f"{exc.message} (run: bash scripts/install.sh --test)", pytrace=False)
    llm = needle_llm(str(path), kv, length)
    info = llm.engine.build_info
    assert info["kv_dtype"] == (kv if kv != "auto" else info["dtype"])
    if model == "smollm2":  # the longest context the model supports
        assert llm.engine.model_config.max_position_embeddings == length
    needles = haystack(llm.tokenizer, length, DEPTHS, seed)
    # Each prompt fills the context but for its answer (and a sentence's slack).
    assert all(length - MAX_NEW - 64 <= len(n.prompt) <= length - MAX_NEW for n in needles)
    hits = []
    for needle, answer in zip(needles, ask(llm, needles), strict=True):
        hits.append(found(answer, needle.secret))
        print(f"{model} {kv} depth {needle.depth:.0%}: {needle.secret} in {answer!r}: {hits[-1]}")
    return hits


@pytest.fixture(scope="module")
def needles_found() -> Found:
    """``_found`` once per model and KV dtype in the module (one engine each, in turn)."""
    return functools.cache(_found)


@pytest.mark.parametrize("model", list(SETUPS))
def test_bf16_kv_finds_the_needles(model: str, needles_found: Found) -> None:
    """What the comparison rests on: with K/V as computed, the needles are found."""
    hits = needles_found(model, "auto")
    assert sum(hits) >= len(DEPTHS) - 1, hits


@pytest.mark.parametrize(("model", "kv"), [(m, kv) for m in SETUPS for kv in ("int8", "fp8")])
def test_quantized_kv_finds_needles_as_often_as_bf16(
    model: str, kv: str, needles_found: Found
) -> None:
    base = needles_found(model, "auto")
    hits = needles_found(model, kv)
    print(f"{model}: {kv} KV found {sum(hits)}/{len(hits)}, bf16 {sum(base)}/{len(base)}")
    assert sum(hits) >= sum(base) - MAY_MISS.get((model, kv), 0), (hits, base)
