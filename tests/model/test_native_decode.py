"""Whole decode layers in one native call: bit-identical to the per-op path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.model import cpu_isa
from kvgate.model.native_decode import NativeDecode
from kvgate.sampling_params import SamplingParams
from tests.engine.stepping import paused_step
from tests.model.isa import vector_levels, vector_path

levels = pytest.mark.parametrize("level", vector_levels())


@pytest.fixture
def forced_level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    level: str = request.param
    monkeypatch.setenv("KVGATE_CPU_ISA", level)
    cpu_isa.default_level.cache_clear()
    yield level
    cpu_isa.default_level.cache_clear()


def _engine(model_dir: Path, quantization: str | None, kv: str = "auto") -> LLMEngine:
    eng = LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype="bfloat16", quantization=quantization,
            kv_cache_memory="32MiB", max_model_len=512, block_size=16, kv_cache_dtype=kv,
        )
    )  # fmt: skip
    # A fresh checkpoint's norms are all ones: make each differ, so a norm used in the wrong
    # place shows (in place: the native layers point at these tensors).
    g = torch.Generator().manual_seed(7)
    model = eng.model
    for norm in [model.final_norm] + [n for w in model.layers for n in (w.input_norm, w.post_norm)]:
        norm.copy_(torch.rand(norm.shape, generator=g) + 0.5)
    return eng


def _run(
    eng: LLMEngine, record: list[torch.Tensor], pauses: list[int] | None = None
) -> dict[str, list[int]]:
    """Three sequences of different lengths (block edges crossed while decoding), greedy;
    every decode step's final hidden states go to ``record``. ``pauses``: the steps are
    advanced layer by layer, as the engine loop does, and each pause is counted there."""
    stepwise = eng.model.stepwise

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        h = yield from stepwise(*args, **kwargs)
        meta = args[3][0] if isinstance(args[3], tuple) else args[3]  # per layer: all alike
        if not meta.prefills:
            record.append(h.clone())
        return h

    eng.model.stepwise = recording  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    for rid, n in (("a", 5), ("b", 14), ("c", 40)):
        eng.add_request(rid, list(range(300, 300 + n)), greedy)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        outs = eng.step() if pauses is None else paused_step(eng, lambda _: pauses.append(1))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


@pytest.mark.parametrize("forced_level", vector_levels(), indirect=True)
@pytest.mark.parametrize(
    ("quantization", "kv", "model"),
    [
        (None, "auto", "tiny_llama_dir"),
        ("int8", "auto", "tiny_llama_dir"),
        ("int8-b32", "auto", "tiny_llama_dir"),
        (None, "int8", "tiny_llama_dir"),
        (None, "fp8", "tiny_llama_dir"),
        (None, "fp8", "tiny_qwen2_dir"),
    ],
)
def test_native_decode_layers_equal_the_per_op_path(
    forced_level: str, quantization: str | None, kv: str, model: str, request: pytest.FixtureRequest
) -> None:
    """Also with K/V stored as int8 or fp8 rows: the layers write them with the fused
    encoder and read them in place, as the per-op path's kernels do (with a Qwen2's key
    offset: each layer's keys stored less it, ``kv_codec.key_offset``)."""
    tiny_llama_dir: Path = request.getfixturevalue(model)
    if forced_level == "generic":
        pytest.skip("no vector path on this CPU: decode runs per op on PyTorch")
    native_eng = _engine(tiny_llama_dir, quantization, kv)
    native = native_eng.model.native_decode
    if native is None:
        pytest.skip("kernels unavailable (no C compiler)")
    assert isinstance(native, NativeDecode) and native.isa == vector_path(forced_level)
    assert native_eng.build_info["decode"] == f"layers-{vector_path(forced_level)}"
    calls = []
    run = native.run
    native.run = lambda step, l0, l1: (calls.append((l0, l1)), run(step, l0, l1))[1]  # type: ignore[method-assign]
    between: list[int] = []  # the pauses, where the engine loop looks for urgent work

    per_op_eng = _engine(tiny_llama_dir, quantization, kv)
    per_op_eng.model.native_decode = None

    got_h: list[torch.Tensor] = []
    want_h: list[torch.Tensor] = []
    got = _run(native_eng, got_h, between)
    want = _run(per_op_eng, want_h)
    assert got == want
    assert len(got_h) == len(want_h) > 20
    for g, w in zip(got_h, want_h, strict=True):
        assert torch.equal(g, w)
    layers = len(native_eng.model.layers)
    # Layer by layer when the step pauses between them, and it paused between each two.
    assert set(calls) == {(i, i + 1) for i in range(layers)}
    assert len(between) >= len(got_h) * (layers - 1)


@levels
def test_native_decode_runs_all_layers_in_one_call_in_a_step_without_pauses(
    level: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if level == "generic":
        pytest.skip("no vector path on this CPU")
    monkeypatch.setenv("KVGATE_CPU_ISA", level)
    cpu_isa.default_level.cache_clear()
    try:
        eng = _engine(tiny_llama_dir, None)
    finally:
        cpu_isa.default_level.cache_clear()
    native = eng.model.native_decode
    if native is None:
        pytest.skip("kernels unavailable (no C compiler)")
    calls = []
    run = native.run
    native.run = lambda step, l0, l1: (calls.append((l0, l1)), run(step, l0, l1))[1]  # type: ignore[method-assign]
    _run(eng, [])
    assert calls and set(calls) == {(0, len(eng.model.layers))}


def test_float32_models_keep_the_per_op_path(tiny_llama_dir: Path) -> None:
    eng = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
                     max_model_len=256)
    )  # fmt: skip
    assert eng.model.native_decode is None
    assert eng.build_info["decode"] == "per-op"
