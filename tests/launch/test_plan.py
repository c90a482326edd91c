"""``kvgate plan`` (``launch/plan.py``, ``model/weight_bytes.py``) against what the engine
really allocates: for an engine built with the plan's ``--kv-cache-memory``, the pool's
blocks, the KV bytes a token and a block, and the blocks one ``max_model_len`` sequence holds
are the plan's exactly, and the model's tensors (walked by ``allocation``: parameters, packed
copies, block views, RoPE tables; each storage once) weigh the plan's weights within 2%.

Fast: tiny random models (HF float32 and bf16, int8, PyTorch-only, GGUF files with mixed
block types kept native), the budget arithmetic, refusals and the CLI. Slow: every shipped
model installed here, in every KV dtype (``SHIPPED``), each checkpoint read once a module.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvgate.config import KV_CACHE_DTYPES, EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.entrypoints.cli import main
from kvgate.errors import InvalidConfig, KVCacheTooSmall, ModelNotFound
from kvgate.launch.plan import Plan, allocation, log_plan, plan_for, render
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.precision import native_blocks_min_bytes
from kvgate.model.registry import resolve_model_path
from tests.conftest import tiny_engine_config
from tests.model.test_gguf_quantized import _model

MiB = 1 << 20
#: The most the predicted weights may be off the model's tensors (the issue's bound).
WEIGHT_TOLERANCE = 0.02
#: A fixed process size for the plans under test, so pools do not depend on what this
#: process loaded before (``plan_for`` measures it otherwise).
PROCESS = 300 * MiB


def _plan(config: EngineConfig, **kwargs: Any) -> Plan:
    return plan_for(config, process_bytes=PROCESS, **kwargs)


def _check(plan: Plan, engine: LLMEngine) -> None:
    """The plan (one KV dtype) against the engine built with its ``--kv-cache-memory``."""
    (kv,) = plan.kv
    got = allocation(engine)
    assert engine.build_info["kv_dtype"] == kv.kv_dtype
    assert got.bytes_per_token == kv.bytes_per_token
    assert got.block_bytes == kv.block_bytes
    assert got.num_blocks == kv.num_blocks
    assert got.seq_blocks == kv.seq_blocks
    assert got.num_blocks // got.seq_blocks == kv.sequences
    assert engine.model.num_parameters() == plan.weights.parameters
    off = plan.weights.total / got.weight_bytes - 1
    assert abs(off) <= WEIGHT_TOLERANCE, (plan.weights, got.weight_bytes)


def _engine_of(plan: Plan, config: EngineConfig) -> LLMEngine:
    (kv,) = plan.kv
    return LLMEngine(
        dataclasses.replace(config, kv_cache_dtype=kv.asked, kv_cache_memory=plan.kv_cache_memory)
    )


# ----------------------------------------------------------------------------- tiny models
@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tiny_models_plan_is_what_its_engine_allocates(
    tiny_llama_dir: Path, dtype: str, kv_dtype: str
) -> None:
    config = tiny_engine_config(tiny_llama_dir, dtype=dtype, kv_cache_dtype=kv_dtype)
    plan = _plan(config, memory=f"{PROCESS // MiB + 128}MiB")
    assert plan.kv[0].num_blocks > 0
    _check(plan, _engine_of(plan, config))


@pytest.mark.parametrize(
    "settings",
    [
        {"quantization": "int8"},  # Q8_0 blocks on the block kernels (or int8 panels)
        {"quantization": "int8-b32", "dtype": "bfloat16"},
        {"native_kernels": False},  # F.linear: a tied head is the embedding's own tensor
        {"native_kernels": False, "dtype": "bfloat16"},  # ... a cast copy here
        {"native_kernels": False, "quantization": "int8"},  # int8 rounded, dequantized
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()),
)
def test_weights_in_each_format_are_predicted(
    tiny_llama_dir: Path, settings: Mapping[str, Any]
) -> None:
    config = tiny_engine_config(tiny_llama_dir, **settings)
    plan = _plan(config)
    _check(plan, _engine_of(plan, config))


@pytest.mark.parametrize("name", ["qwen2-mixed", "llama-Q4_0"])
@pytest.mark.parametrize("blocks", ["native", "auto", "dequantize"])
def test_a_gguf_with_block_matrices_kept_or_dequantized(
    tmp_path: Path, name: str, blocks: str
) -> None:
    """``qwen2-mixed``: every native block type, one Q2_K and one F16 matrix (their fused
    layers go dense), q/k/v biases, an untied head. ``auto``: the tiny model is far under the
    size from which blocks stay native where this CPU's kernels have a size limit, so they are
    dequantized there (and kept native where every size is, the VNNI blocks beside the
    AVX-512 bf16 linear: ``precision.NATIVE_BLOCKS_MIN_BYTES_BY_PATH``)."""
    path = _model(tmp_path, name)
    config = EngineConfig(
        model=str(path), gguf_blocks=blocks, kv_cache_memory="16MiB", max_model_len=256
    )
    plan = _plan(config)
    every_size = native_blocks_min_bytes(CpuKernels.probe(enabled=True).paths()) == 0
    if blocks == "dequantize" or (blocks == "auto" and not every_size):
        assert "dequantized" in plan.weights.why
    elif blocks == "auto":
        assert "kept native" in plan.weights.why
    _check(plan, _engine_of(plan, config))


def test_the_weights_check_can_fail(tiny_llama_dir: Path) -> None:
    """A plan that forgot the tied head's bf16 copy would be off by far more than 2%."""
    config = tiny_engine_config(tiny_llama_dir, dtype="bfloat16")
    plan = _plan(config)
    assert plan.weights.head > 0  # its own packed copy
    forgot = dataclasses.replace(plan, weights=dataclasses.replace(plan.weights, head=0))
    with pytest.raises(AssertionError):
        _check(forgot, _engine_of(plan, config))


# ----------------------------------------------------------------------------- arithmetic
def test_the_budget_is_memory_less_weights_runtime_and_margin(tiny_llama_dir: Path) -> None:
    config = tiny_engine_config(tiny_llama_dir)
    for margin in (0.0, 0.1, 0.5):
        plan = _plan(config, memory="1GiB", margin=margin)
        fixed = plan.weights.total + plan.runtime.total
        assert plan.memory == 1 << 30 and plan.margin_bytes == int((1 << 30) * margin)
        assert plan.kv_budget == (1 << 30) - fixed - plan.margin_bytes
        assert plan.kv_cache_memory == f"{plan.kv_budget // MiB}MiB"
        (kv,) = plan.kv
        assert kv.num_blocks == plan.kv_budget // MiB * MiB // kv.block_bytes
        assert plan.runtime.process == PROCESS


def test_without_memory_the_pool_is_kv_cache_memory_and_the_total_is_said(
    tiny_llama_dir: Path,
) -> None:
    config = tiny_engine_config(tiny_llama_dir, kv_cache_memory="64MiB")
    plan = _plan(config)
    (kv,) = plan.kv
    assert not plan.memory_given and plan.kv_cache_memory == "64MiB"
    assert kv.num_blocks == 64 * MiB // kv.block_bytes
    held = plan.weights.total + plan.runtime.total + 64 * MiB
    assert plan.memory % MiB == 0 and held <= plan.memory * (1 - plan.margin) < held + MiB
    # that total, given back as --memory, plans the same pool again
    again = _plan(config, memory=str(plan.memory))
    assert again.kv_cache_memory == "64MiB" and again.kv[0].num_blocks == kv.num_blocks


@pytest.mark.parametrize("n", [1, 3, 40])
def test_the_memory_said_for_n_sequences_holds_them(tiny_llama_dir: Path, n: int) -> None:
    config = tiny_engine_config(tiny_llama_dir, kv_cache_dtype="int8")
    (kv,) = _plan(config, concurrency=n).kv
    assert kv.memory_for_concurrency is not None
    (got,) = _plan(config, memory=str(kv.memory_for_concurrency), concurrency=n).kv
    assert got.sequences >= n
    assert (
        got.kv_cache_memory_for_concurrency == f"{-(-n * kv.seq_blocks * kv.block_bytes // MiB)}MiB"
    )
    (less,) = _plan(config, memory=str(kv.memory_for_concurrency - 2 * MiB)).kv
    assert less.sequences < got.sequences  # no slack to spare: the memory is what they need


def test_several_kv_dtypes_share_the_budget(tiny_llama_dir: Path) -> None:
    config = tiny_engine_config(tiny_llama_dir)  # float32: auto is float32
    plan = _plan(config, memory="512MiB", kv_dtypes=KV_CACHE_DTYPES)
    assert [(kv.asked, kv.kv_dtype) for kv in plan.kv] == [
        ("auto", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8"), ("fp8", "fp8"),
    ]  # fmt: skip
    by = {kv.kv_dtype: kv for kv in plan.kv}
    assert by["float32"].bytes_per_token == 2 * by["bfloat16"].bytes_per_token
    # int8 rows: head_dim 16 values, one float32 scale (fewer than 32 values)
    assert by["int8"].bytes_per_token == by["bfloat16"].bytes_per_token // 2 * (16 + 4) // 16
    pool = plan.kv_budget // MiB * MiB  # one budget, each dtype's blocks in it
    assert all(kv.num_blocks == pool // kv.block_bytes for kv in plan.kv)
    table = render(plan)
    assert all(f"{kv.num_blocks:,}" in table for kv in plan.kv)
    assert "float32 (auto)" in table


# ----------------------------------------------------------------------------- refusals
def test_a_pool_short_of_one_sequence_is_zero_and_the_engine_refuses_it(
    tiny_llama_dir: Path,
) -> None:
    config = tiny_engine_config(tiny_llama_dir, max_model_len=512)
    (kv,) = _plan(config).kv
    one = kv.seq_blocks * kv.block_bytes
    short = dataclasses.replace(config, kv_cache_memory=one - 1)
    short_plan = _plan(short)
    assert short_plan.kv[0].sequences == 0 and not short_plan.fits
    with pytest.raises(KVCacheTooSmall):
        LLMEngine(short)
    exact = dataclasses.replace(config, kv_cache_memory=one)
    assert _plan(exact).kv[0].sequences == 1
    assert LLMEngine(exact).kv_pool.num_blocks == kv.seq_blocks


def test_weights_beyond_the_memory_leave_no_pool(tiny_llama_dir: Path) -> None:
    plan = _plan(tiny_engine_config(tiny_llama_dir), memory="200MiB")  # < PROCESS alone
    assert plan.kv_budget == 0 and plan.kv[0].num_blocks == 0 and not plan.fits
    assert plan.kv_cache_memory == "0MiB"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"memory": "lots"}, "memory"),
        ({"memory": "0"}, "memory"),
        ({"margin": 1.0}, "margin"),
        ({"margin": -0.1}, "margin"),
        ({"concurrency": 0}, "concurrency"),
        ({"kv_dtypes": ["int4"]}, "kv_cache_dtype"),
    ],
)
def test_bad_settings_name_themselves(
    tiny_llama_dir: Path, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidConfig) as caught:
        _plan(tiny_engine_config(tiny_llama_dir), **kwargs)
    assert caught.value.param == param


def test_a_context_beyond_the_models_is_refused_as_the_engine_refuses_it(
    tiny_llama_dir: Path,
) -> None:
    config = tiny_engine_config(tiny_llama_dir, max_model_len=4096)  # the model has 2048
    with pytest.raises(InvalidConfig) as planned:
        _plan(config)
    with pytest.raises(InvalidConfig) as built:
        LLMEngine(config)
    assert planned.value.message == built.value.message


# ----------------------------------------------------------------------------- the CLI, serve
def test_kvgate_plan_prints_a_row_per_kv_dtype(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", str(tiny_llama_dir), "--dtype", "float32", "--memory", "64GiB",
            "--max-model-len", "1024", "--concurrency", "4"]  # fmt: skip
    assert main(argv) == 0  # a plan: nothing of 64 GiB is allocated
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[:1] in (["float32"], ["int8"])]
    assert len(rows) == 2 and all(" yes " in line for line in rows)
    assert "--kv-cache-memory" in out and "sequences of 1024 tokens" in out


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--memory", "lots"], "memory must look like"),
        (["--max-model-len", "99999"], "exceeds the model's context"),
        (["--margin", "2"], "margin must be in"),
        (["--concurrency", "-1"], "concurrency must be a positive"),
    ],
)
def test_kvgate_plan_refuses_bad_input_in_one_line(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    assert main(["plan", "--model", str(tiny_llama_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvgate: error: ") and says in err


def test_kvgate_plan_refuses_an_unknown_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", str(tmp_path / "none.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err and "Traceback" not in err


def test_kvgate_plan_exits_1_when_nothing_fits(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", str(tiny_llama_dir), "--memory", "1MiB", "--kv-cache-dtype", "int8"]
    assert main(argv) == 1
    assert "int8" in capsys.readouterr().out


def test_serve_logs_the_plan_and_a_failed_plan_never_stops_it(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tiny_engine_config(tiny_llama_dir)
    with caplog.at_level(logging.INFO, logger="kvgate.plan"):
        plan = log_plan(config, "tiny")
        assert plan is not None
        assert log_plan(dataclasses.replace(config, model=str(tmp_path / "gone")), "x") is None
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("plan tiny: ") and f"{plan.kv[0].num_blocks:,}" in m for m in logged)
    assert any("no memory plan" in m and "not found" in m for m in logged)


# ----------------------------------------------------------------------------- shipped models
#: The models kvgate ships (``model/registry.py``), and the weight settings each is also
#: checked in beside ``--dtype auto`` (those that load in a few seconds).
SHIPPED = {
    "smollm2": [{"dtype": "float32"}, {"quantization": "int8"}, {"gguf_blocks": "native"}],
    "gemma3-270m": [{"gguf_blocks": "native"}],
    "qwen2.5-coder-1.5b": [],
}


@pytest.fixture(scope="module")
def read_once() -> Iterator[None]:
    """The engine's own load, with each checkpoint read (and dequantized) once for the
    module: the engines of one model differ only in what is built from the weights."""
    import kvgate.engine.llm_engine as llm_engine

    loaded: dict[tuple[str, bool], Any] = {}
    flat: dict[tuple[int, ...], Any] = {}
    load, dequantized = llm_engine.load_checkpoint, llm_engine.dequantized

    def load_once(model: str, *, keep_quantized: bool = False) -> Any:
        key = (model, keep_quantized)
        if key not in loaded:
            loaded[key] = load(model, keep_quantized=keep_quantized)
        checkpoint = loaded[key]
        return dataclasses.replace(checkpoint, weights=dict(checkpoint.weights))

    def dequantize_once(weights: Mapping[str, Any]) -> Any:
        key = tuple(map(id, weights.values()))  # the cached checkpoint's own tensors
        if key not in flat:
            flat[key] = dequantized(weights)
        return dict(flat[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "load_checkpoint", load_once)
        patch.setattr(llm_engine, "dequantized", dequantize_once)
        yield


def _shipped(model: str) -> str:
    try:
        resolve_model_path(model)
    except ModelNotFound as exc:
        pytest.skip(f"{model} is not installed here: {exc.message}")
    return model


def _real_check(model: str, **settings: Any) -> None:
    """Plan for a ~256 MiB pool inside a total the plan itself gives, then build it."""
    config = EngineConfig(model=model, max_model_len=4096, **settings)
    sized = _plan(dataclasses.replace(config, kv_cache_memory="256MiB"))
    plan = _plan(config, memory=str(sized.memory))
    assert plan.kv_budget >= 256 * MiB and plan.kv[0].sequences >= 1
    _check(plan, _engine_of(plan, config))


@pytest.mark.slow
@pytest.mark.usefixtures("read_once")
@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("model", list(SHIPPED))
def test_a_shipped_models_plan_is_what_its_engine_allocates(model: str, kv_dtype: str) -> None:
    _real_check(_shipped(model), kv_cache_dtype=kv_dtype)


@pytest.mark.slow
@pytest.mark.usefixtures("read_once")
@pytest.mark.parametrize(
    ("model", "settings"),
    [(model, s) for model, variants in SHIPPED.items() for s in variants],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_a_shipped_models_weights_in_other_formats(model: str, settings: dict[str, Any]) -> None:
    _real_check(_shipped(model), **settings)
