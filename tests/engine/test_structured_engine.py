"""Constrained decoding in the engine, on the tiny random-weight model: whatever the weights
say, every output matches its grammar; constrained and unconstrained requests share steps
without changing each other; a grammar's state survives preemption."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.stats import IterationStats
from kvgate.errors import InvalidRequest
from kvgate.sampling_params import SamplingParams
from kvgate.structured.spec import Grammar, choice_grammar, json_schema_grammar, regex_grammar
from tests.conftest import tiny_engine_config

SCHEMAS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "schemas.json").read_text()
)
PROMPT = "Write JSON about it:"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_engine_config(tiny_llama_dir))


def run(engine: LLMEngine, jobs: Sequence[tuple[str, SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every job at once (one batch), step to the end; the final output of each."""
    for i, (prompt, params) in enumerate(jobs):
        engine.add_request(f"r{i}-{id(jobs)}", prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = out
    return done


def params(grammar: Grammar | None, *, temperature: float = 1.0, seed: int = 0,
           max_tokens: int = 400) -> SamplingParams:  # fmt: skip
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, grammar=grammar,
        final_only=True,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_weights_still_write_valid_json(engine: LLMEngine, name: str) -> None:
    schema = SCHEMAS[name]["schema"]
    grammar = json_schema_grammar(schema, "response_format")
    jobs = [(PROMPT, params(grammar, seed=s)) for s in range(4)]
    jobs.append((PROMPT, params(grammar, temperature=0.0)))
    for out in run(engine, jobs).values():
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice_hold_at_any_temperature(engine: LLMEngine) -> None:
    pattern = r"[A-Z]{2}-[0-9]{3}( \(urgent\))?"
    choices = ["red", "green", "blue", "light blue"]
    jobs = [(PROMPT, params(regex_grammar(pattern, "r"), seed=s)) for s in range(4)]
    jobs += [(PROMPT, params(choice_grammar(choices, "c"), seed=s)) for s in range(4)]
    outs = run(engine, jobs)
    for i in range(4):
        assert re.fullmatch(pattern, outs[f"r{i}"].text), outs[f"r{i}"].text
        assert outs[f"r{i + 4}"].text in choices
        assert outs[f"r{i}"].finish_reason == outs[f"r{i + 4}"].finish_reason == "stop"


def test_unconstrained_greedy_rows_are_untouched_by_constrained_neighbours(
    engine: LLMEngine,
) -> None:
    free = [(f"plain prompt number {i}", params(None, temperature=0.0, max_tokens=24))
            for i in range(3)]  # fmt: skip
    alone = run(engine, free)
    grammar = json_schema_grammar(SCHEMAS["order"]["schema"], "response_format")
    mixed_jobs = free + [(PROMPT, params(grammar, seed=s)) for s in range(3)]
    batch_sizes: list[int] = []

    class Sizes:
        def on_step(self, stats: IterationStats) -> None:
            batch_sizes.append(stats.batch_size)

    engine.listeners.append(Sizes())
    try:
        mixed = run(engine, mixed_jobs)
    finally:
        engine.listeners.pop()
    assert max(batch_sizes) == 6  # constrained and unconstrained in the same steps
    for i in range(3):
        assert mixed[f"r{i}"].new_token_ids == alone[f"r{i}"].new_token_ids
        assert len(alone[f"r{i}"].new_token_ids) == 24


def test_preemption_mid_generation_resumes_the_grammar(tiny_llama_dir: Path) -> None:
    # A pool of a few blocks for 6 long constrained requests: they preempt and recompute.
    # 8 KiB per block of 16 tokens: 20 blocks, 16 of them for one request at most.
    small = LLMEngine(
        tiny_engine_config(tiny_llama_dir, kv_cache_memory="160KiB", max_model_len=256)
    )
    schema = SCHEMAS["person"]["schema"]
    grammar = json_schema_grammar(schema, "response_format")
    outs = run(small, [(PROMPT * 4, params(grammar, seed=s, max_tokens=200)) for s in range(6)])
    assert small.scheduler.num_preemptions > 0
    for out in outs.values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_max_tokens_before_the_grammar_completes_is_length(engine: LLMEngine) -> None:
    grammar = json_schema_grammar(SCHEMAS["person"]["schema"], "response_format")
    out = run(engine, [(PROMPT, params(grammar, max_tokens=3))])["r0"]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_a_grammar_that_does_not_compile_is_refused_naming_its_field(
    engine: LLMEngine,
) -> None:
    bad = regex_grammar("([0-9]{3", "response_format.regex")
    with pytest.raises(InvalidRequest) as info:
        engine.make_request("bad", PROMPT, params(bad))
    assert info.value.param == "response_format.regex"
    assert "regex" in info.value.message
    assert not engine.has_unfinished()


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never expected (the mask allows only what the grammar allows), but if it happened the
    request must end as an error, not as a valid-looking output."""
    sampler = engine.runner.sampler
    unmasked = type(sampler).__call__

    def ignore_masks(self: Any, logits: Any, states: Any, allowed: Any = None) -> Any:
        return unmasked(self, logits, states, None)

    monkeypatch.setattr(type(sampler), "__call__", ignore_masks)
    grammar = regex_grammar("[0-9]{40}", "r")  # random weights will soon write a non-digit
    out = run(engine, [(PROMPT, params(grammar, temperature=1.0, seed=5))])["r0"]
    assert out.finish_reason == "error"
    assert out.error is not None and "constrained decoding failed" in out.error
