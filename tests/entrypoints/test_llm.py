"""The offline API: batching, seeds, stop strings, sampling through the real runner."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=512)


def test_outputs_come_back_in_prompt_order(llm: LLM) -> None:
    prompts = [[100 + i] * (i + 1) for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in prompts]
    assert all(len(o.token_ids) == 3 for o in outs)


def test_same_seed_same_output_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    (alone,) = llm.generate([[7, 8, 9, 10]], seeded)
    noise = [SamplingParams(max_tokens=20, temperature=1.3, ignore_eos=True)] * 5
    crowd = llm.generate(
        [[1000 + i] * (10 + 7 * i) for i in range(5)] + [[7, 8, 9, 10]], [*noise, seeded]
    )
    assert crowd[-1].token_ids == alone.token_ids
    (other,) = llm.generate(
        [[7, 8, 9, 10]],
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True),
    )
    assert other.token_ids != alone.token_ids


def test_stop_string_ends_generation_and_is_cut(llm: LLM) -> None:
    (free,) = llm.generate(
        [[300, 301, 302]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    assert len(free.text) > 6
    stop = free.text[3:6]  # some text the model will produce
    (cut,) = llm.generate(
        [[300, 301, 302]],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
    )
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]
    (kept,) = llm.generate(
        [[300, 301, 302]],
        SamplingParams(
            max_tokens=30,
            temperature=0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    (free,) = llm.generate(
        [[300, 301, 302]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    target = free.token_ids[4]
    (stopped,) = llm.generate(
        [[300, 301, 302]],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(target,)),
    )
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(target) + 1]


def test_text_prompt_and_chat(llm: LLM) -> None:
    (out,) = llm.generate(["Hello there"], SamplingParams(max_tokens=4))
    assert len(out.prompt_token_ids) == len(llm.engine.tokenizer.encode("Hello there"))
    reply = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))
    assert 1 <= len(reply.token_ids) <= 3
