"""The synchronous engine: validation, abort, error isolation, block accounting."""

from __future__ import annotations

import random
import shutil
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.messages import RunnerOutput, SchedulerOutput
from kvgate.engine.step_handle import RunnerStep
from kvgate.errors import (
    CorruptWeights,
    DuplicateRequestId,
    EmptyPrompt,
    InvalidConfig,
    InvalidRequest,
    InvalidSamplingParams,
    KVCacheTooSmall,
    ModelNotFound,
    PromptTooLong,
)
from kvgate.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(
        tiny_engine_config(tiny_llama_dir, kv_cache_memory="32MiB", max_num_batched_tokens=64)
    )


def _drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[Any]]:
    outs: dict[str, list[Any]] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        assert steps < max_steps
    return outs


def _assert_no_blocks_held(engine: LLMEngine) -> None:
    pool = engine.kv_cache.pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0
    assert not engine.kv_cache.req_blocks
    assert not engine.runner.states or all(
        rid not in engine.scheduler.requests for rid in engine.runner.states
    )


def test_empty_prompt_is_refused(engine: LLMEngine) -> None:
    for prompt in ("", []):
        with pytest.raises(EmptyPrompt) as err:
            engine.add_request("e", prompt, SamplingParams())
        assert err.value.param == "prompt"


def test_prompt_over_context_names_the_numbers(engine: LLMEngine) -> None:
    with pytest.raises(PromptTooLong) as err:
        engine.add_request("long", [500] * 600, SamplingParams(max_tokens=4))
    assert err.value.param == "prompt"
    assert "512" in err.value.message and "600" in err.value.message
    with pytest.raises(PromptTooLong):  # prompt fits, but not with the tokens asked for
        engine.add_request("long2", [500] * 500, SamplingParams(max_tokens=20))


def test_token_ids_outside_vocab_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequest, match="49152"):
        engine.add_request("v", [1, 2, 10**6], SamplingParams())


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"seed": -(2**63) - 1}, "seed"),  # found by the server's schema fuzz test
        ({"seed": 2**64}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_duplicate_request_id(engine: LLMEngine) -> None:
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestId):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    _drain(engine)
    _assert_no_blocks_held(engine)


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFound, match="no-such-model"):
        LLMEngine(EngineConfig(model=str(missing)))


def test_corrupt_weights_file_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CorruptWeights, match=r"model\.safetensors"):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_bad_engine_settings(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidConfig) as err:
        EngineConfig(dtype="int3")
    assert err.value.param == "dtype"
    with pytest.raises(InvalidConfig) as err:
        EngineConfig(kv_cache_memory="lots")
    assert err.value.param == "kv_cache_memory"
    with pytest.raises(InvalidConfig) as err:
        EngineConfig(num_spare_seqs=-1)
    assert err.value.param == "num_spare_seqs"
    with pytest.raises(KVCacheTooSmall, match="max_model_len"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="4KiB"))
    with pytest.raises(InvalidConfig) as err:
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=100_000))
    assert err.value.param == "max_model_len"


def test_cancel_storm_on_the_real_engine(engine: LLMEngine) -> None:
    """100 requests through the model, 30 aborted at random points: zero blocks leaked."""
    rng = random.Random(11)
    shared = [rng.randrange(100, 49000) for _ in range(40)]
    for i in range(100):
        prompt = shared[: rng.randrange(0, 40)] + [
            rng.randrange(100, 49000) for _ in range(rng.randrange(1, 60))
        ]
        engine.add_request(
            f"storm-{i}",
            prompt,
            SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.8, seed=i),
        )
    doomed = set(rng.sample(range(100), 30))
    finish: dict[str, str | None] = {}
    steps = 0
    while engine.has_unfinished():
        live = [i for i in doomed if f"storm-{i}" in engine.scheduler.requests]
        if live and rng.random() < 0.4:
            victim = rng.choice(live)
            engine.abort([f"storm-{victim}"])
            doomed.discard(victim)
        for out in engine.step():
            if out.finished:
                finish[out.request_id] = out.finish_reason
        steps += 1
        assert steps < 20_000
    assert len(finish) == 100  # every request ended with a final output
    assert sum(r == "abort" for r in finish.values()) >= 15
    _assert_no_blocks_held(engine)
    # Finished requests' runner state is dropped on the next step.
    engine.step()
    assert not engine.runner.states


class _PoisonRunner:
    """Wraps the real runner; the step containing the poisoned request raises: as it starts,
    or at its first pause between two layers (``inside``)."""

    def __init__(self, inner: Any, poison: str, inside: bool) -> None:
        self.inner = inner
        self.poison = poison
        self.inside = inside

    def start(self, out: SchedulerOutput, pause: bool = False) -> RunnerStep:
        step: RunnerStep = self.inner.start(out, pause)
        if not any(s.request_id == self.poison for s in out.sequences):
            return step
        if not self.inside:
            raise RuntimeError("simulated kernel failure")

        def fails_inside() -> Generator[None, None, RunnerOutput]:
            step.advance()
            yield
            step.close()
            raise RuntimeError("simulated kernel failure")

        return RunnerStep(fails_inside())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("inside", [False, True], ids=["at-start", "inside-the-forward"])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(
    tiny_llama_dir: Path, inside: bool
) -> None:
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256
        )
    )
    eng.runner = _PoisonRunner(eng.runner, "poison", inside)  # type: ignore[assignment]
    prompt = list(range(1000, 1040))  # two full blocks: cacheable, had the step succeeded
    eng.add_request("poison", prompt, SamplingParams(max_tokens=4))
    outs = _drain(eng)
    assert outs["poison"][-1].finish_reason == "error"
    assert "simulated kernel failure" in (outs["poison"][-1].error or "")
    # The failed step's blocks never received KV: none may be served from the prefix cache.
    assert eng.kv_cache.pool.num_cached_blocks == 0
    eng.add_request("healthy", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    outs = _drain(eng)
    assert outs["healthy"][-1].finish_reason == "length"
    assert outs["healthy"][-1].num_cached_tokens == 0
    assert eng.kv_cache.pool.num_used_blocks == 0


def test_block_size_beyond_the_native_kernel_falls_back_to_torch(tiny_llama_dir: Path) -> None:
    def run(block_size: int) -> list[int]:
        eng = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                     kv_cache_memory="32MiB", max_model_len=512,
                                     block_size=block_size))  # fmt: skip
        greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        eng.add_request("r", list(range(200, 330)), greedy)
        outs = _drain(eng)["r"]
        assert outs[-1].finish_reason == "length"
        return [t for o in outs for t in o.new_token_ids]

    assert run(128) == run(16)


def test_deltas_and_final_output(engine: LLMEngine) -> None:
    engine.add_request(
        "d", [100, 200, 300], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    )
    outs = _drain(engine)["d"]
    assert [o.finished for o in outs] == [False] * 5 + [True]
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 6
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 6 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert [lp.token_id for lp in lps] == [t for o in outs for t in o.new_token_ids]


def test_a_final_only_request_reports_once_with_everything(engine: LLMEngine) -> None:
    """The one output of a final-only request holds what the deltas of the same request
    would have held together: every token, the whole text, every logprob, how it ended."""
    prompt = [100, 200, 300, 400]
    base = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1, temperature=0)
    deltas = _drain_one(engine, "stream", prompt, base)
    text = "".join(o.text for o in deltas)
    stop = text[len(text) // 2 :][:3]  # a stop string met mid-way
    assert stop
    for params in (base, replace(base, stop=(stop,))):
        deltas = _drain_one(engine, "stream", prompt, params)
        (whole,) = _drain_one(engine, "whole", prompt, replace(params, final_only=True))
        assert whole.finished and whole.finish_reason == deltas[-1].finish_reason
        assert whole.new_token_ids == tuple(t for o in deltas for t in o.new_token_ids)
        assert whole.text == "".join(o.text for o in deltas)
        assert whole.logprobs == tuple(lp for o in deltas for lp in o.logprobs)
        assert whole.num_output_tokens == deltas[-1].num_output_tokens
        assert whole.metrics is not None and whole.metrics.first_token_time is not None
    _assert_no_blocks_held(engine)


def _drain_one(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[Any]:
    engine.add_request(request_id, prompt, params)
    return _drain(engine)[request_id]
