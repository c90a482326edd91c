"""GGUF files whose matrices are in GGML block formats: ``load_gguf(keep_quantized=True)``
keeps them as views of the file's map (the values those of the default, dequantizing load),
refuses a truncated file by name before reading anything, and whole models run on the native
block kernels as their dequantized selves do."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

import kvgate.model.gguf_loader as gguf_loader
from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.errors import CorruptWeights
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.cpu_kernels import load_quant_lib
from kvgate.model.linear import TorchLinear
from kvgate.model.quant_linear import QuantEmbedding, QuantLinear
from kvgate.model.quant_tensor import NATIVE_QTYPES, QuantTensor
from kvgate.model.row_roles import RowRoles
from tests.gguf_writer import TINY_TOKENS, write_tiny_header
from tests.model.quant_blocks import _F16_FIELDS, quantize_activations, random_blocks
from tests.model.steps import one_prefill

Q = GGMLQuantizationType
#: Types gguf-py can quantize to (the others are written as random blocks).
GGUF_PY_QUANTIZES = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}

# ------------------------------------------------------------------ a tiny file, by hand

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # K-quants need K % 256 == 0
HEAD_DIM = HIDDEN // HEADS
TOKENS = TINY_TOKENS
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
#: Every native type somewhere, as a Q4_K_M file mixes them, plus a block format without a
#: native kernel (Q2_K) and a float one (F16): those two are read as without keep_quantized.
MIXED = {
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.Q6_K,
    "attn_q.weight": Q.Q4_K,
    "attn_k.weight": Q.Q4_0,
    "attn_v.weight": Q.Q6_K,
    "attn_output.weight": Q.Q5_0,
    "ffn_gate.weight": Q.Q5_K,
    "ffn_up.weight": Q.Q4_1,
    "ffn_down.weight": Q.Q5_1,
    "blk.1.ffn_gate.weight": Q.Q2_K,
    "blk.1.attn_output.weight": Q.F16,
}


def _gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def _state(arch: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the tiny shape (q/k/v biases for qwen2), in HF names and order."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (len(TOKENS), HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
        if arch == "qwen2":
            for proj, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (n * HEAD_DIM,)
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (len(TOKENS), HIDDEN)}
    return {  # norms 0.5..1.5, biases large enough to matter, weights of ~0.05
        name: (torch.rand(s, generator=g) + 0.5) if name.endswith("norm.weight")
        else torch.randn(s, generator=g) * (0.3 if name.endswith("bias") else 0.05)
        for name, s in shapes.items()
    }  # fmt: skip


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _blocks(qtype: GGMLQuantizationType, array: np.ndarray, seed: int) -> np.ndarray:
    """uint8 [rows, row bytes] of ``array`` in ``qtype``: gguf-py's quantization where it
    has one, else random blocks (finite scales) of the shape."""
    if qtype in GGUF_PY_QUANTIZES:
        return quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
    rows, k = array.shape
    rng = np.random.default_rng(seed)
    if qtype in NATIVE_QTYPES:  # scales brought down to weights of ~0.05, as a real layer's
        raw = random_blocks(qtype, rows, k, rng)
        size = float(np.abs(dequantize(raw, qtype)).mean())
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
        for at in _F16_FIELDS[qtype]:  # w is linear in d (and dmin)
            f16 = blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)
            blocks[:, at : at + 2] = (f16 * (0.05 / size)).astype(np.float16).view(np.uint8)
        return raw
    # Q2_K: 84 B per 256 inputs: scales, 2-bit values, f16 d and dmin at 80 and 82
    assert qtype == Q.Q2_K and GGML_QUANT_SIZES[qtype] == (256, 84)
    raw = rng.integers(0, 256, size=(rows * k // 256, 84), dtype=np.uint8)
    raw[:, 80:84] = rng.uniform(1e-3, 1e-2, (len(raw), 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _write(
    path: Path, state: dict[str, torch.Tensor], arch: str, types: dict[str, GGMLQuantizationType]
) -> None:
    """``state`` as llama.cpp's converter writes it (Llama's q/k rows permuted); a matrix in
    the type ``types`` names for its GGUF name or the name's suffix, else float32."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    write_tiny_header(
        writer, layers=LAYERS, hidden=HIDDEN, inter=INTER, heads=HEADS, kv_heads=KV_HEADS
    )
    for seed, (name, tensor) in enumerate(state.items()):
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _permute(array, HEADS)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _permute(array, KV_HEADS)
        gguf = _gguf_name(name)
        qtype = types.get(gguf, types.get(gguf.split(".", 2)[-1], Q.F32))
        if array.ndim == 2 and qtype == Q.F16:
            writer.add_tensor(gguf, array.astype(np.float16))
        elif array.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(gguf, _blocks(qtype, array, seed), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    """The memory maps ``load_gguf`` makes, as it makes them."""
    maps: list[np.ndarray] = []
    original = gguf_loader._map

    def recording(file: str) -> np.ndarray:
        maps.append(original(file))
        return maps[-1]

    monkeypatch.setattr(gguf_loader, "_map", recording)
    return maps


def _inside(t: torch.Tensor, buf: np.ndarray) -> bool:
    start = buf.ctypes.data
    return start <= t.data_ptr() and t.data_ptr() + t.numel() <= start + buf.nbytes


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_block_matrices_stay_views_of_the_file_with_the_default_loads_values(
    arch: str, tmp_path: Path, mapped: list[np.ndarray]
) -> None:
    path = tmp_path / f"{arch}.gguf"
    _write(path, _state(arch), arch, MIXED)
    kept = load_checkpoint(path, keep_quantized=True)
    (buf,) = mapped
    plain = load_checkpoint(path)
    assert set(kept.weights) == set(plain.weights)
    assert kept.config == plain.config

    reader = GGUFReader(path)
    written = {t.name: GGMLQuantizationType(t.tensor_type) for t in reader.tensors}
    counts: dict[str, int] = {}
    for name, w in kept.weights.items():
        gguf, expected = _gguf_name(name), plain.weights[name]
        assert isinstance(expected, torch.Tensor)  # the default load dequantizes everything
        qtype = written[gguf]
        permuted = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        if qtype in NATIVE_QTYPES and expected.dim() == 2:
            assert isinstance(w, QuantTensor), name
            assert (w.qtype, w.shape, w.name) == (qtype, tuple(expected.shape), gguf)
            assert torch.equal(w.dequantize(), expected), name
            # the file's bytes in place, except Llama's q/k: their rows, permuted, are copies
            assert _inside(w.data, buf) != permuted, name
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        else:  # norms, biases, F16, and Q2_K (no native kernel): as the default load reads
            assert isinstance(w, torch.Tensor), name
            assert w.dtype == expected.dtype and torch.equal(w, expected), name
            assert not _inside(w, buf), name
    o_proj, gate = (
        plain.weights[f"model.layers.1.{n}.weight"] for n in ("self_attn.o_proj", "mlp.gate_proj")
    )
    assert isinstance(o_proj, torch.Tensor) and o_proj.dtype == torch.float16  # F16
    assert isinstance(gate, torch.Tensor) and gate.dtype == torch.float32  # Q2_K, dequantized
    assert set(counts) == {t.name for t in NATIVE_QTYPES}
    assert sum(counts.values()) == 2 + 7 * LAYERS - 2


def test_llama_q_and_k_rows_come_back_unpermuted_either_way(tmp_path: Path) -> None:
    """llama.cpp stores Llama's q/k rows permuted; the rows are whole blocks, so the kept
    tensors' rows are put back as the default load puts back the dequantized ones."""
    state = _state("llama")
    path = tmp_path / "llama.gguf"
    types = {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_0, "ffn_down.weight": Q.Q5_1}
    _write(path, state, "llama", types)
    kept = load_checkpoint(path, keep_quantized=True).weights
    plain = load_checkpoint(path).weights
    for i in range(LAYERS):
        for proj, qtype in (("q", Q.Q8_0), ("k", Q.Q4_0)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            w = kept[name]
            assert isinstance(w, QuantTensor) and w.qtype == qtype
            # each row quantized on its own: the permutation commutes with quantization
            original = state[name].numpy()
            want = torch.from_numpy(dequantize(quantize(original, qtype), qtype))
            assert torch.equal(w.dequantize(), want)
            assert torch.equal(plain[name], want)  # type: ignore[arg-type]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tensors ``load_gguf`` reads or takes a view of, in order."""
    names: list[str] = []
    read_tensor = gguf_loader._read_tensor

    def reading(buf: Any, start: int, nbytes: int, info: Any, file: str) -> torch.Tensor:
        names.append(info.name)
        return read_tensor(buf, start, nbytes, info, file)

    def viewing(qtype: Any, shape: Any, data: torch.Tensor, name: str) -> QuantTensor:
        names.append(name)
        return QuantTensor(qtype, shape, data, name)

    monkeypatch.setattr(gguf_loader, "_read_tensor", reading)
    monkeypatch.setattr(gguf_loader, "QuantTensor", viewing)
    return names


@pytest.mark.parametrize("keep_quantized", [True, False])
@pytest.mark.parametrize(
    "cut_in", ["token_embd.weight", "blk.0.ffn_up.weight", "blk.1.attn_v.weight", "output.weight"]
)
def test_a_file_cut_inside_a_tensor_is_refused_by_name_before_any_read(
    tmp_path: Path, reads: list[str], keep_quantized: bool, cut_in: str
) -> None:
    """A map of a short file faults (SIGBUS) on the first access past its end: every
    tensor's extent is checked first, and the first one cut short is named."""
    path = tmp_path / "cut.gguf"
    _write(path, _state("qwen2"), "qwen2", MIXED)
    (tensor,) = [t for t in GGUFReader(path).tensors if t.name == cut_in]
    data = path.read_bytes()
    path.write_bytes(data[: tensor.data_offset + tensor.n_bytes // 2])
    with pytest.raises(CorruptWeights, match=rf"cut\.gguf: tensor '{cut_in}' is truncated"):
        load_checkpoint(path, keep_quantized=keep_quantized)
    assert reads == []
    # the file whole: every tensor read (or viewed) once
    path.write_bytes(data)
    load_checkpoint(path, keep_quantized=keep_quantized)
    assert len(reads) == len(GGUFReader(path).tensors)


# ------------------------------------------------------------- whole models, through the engine

MATRICES = ("token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight",
            "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
            "ffn_down.weight")  # fmt: skip
#: arch, types: every matrix (embedding and head too) in one type as llama.cpp's Q8_0 /
#: Q4_0 / Q5_0 files, or MIXED (fused q/k/v of three types, gate/up of two, one layer's
#: gate in Q2_K: that gate/up dequantized).
MODELS = {
    "llama-Q8_0": ("llama", dict.fromkeys(MATRICES, Q.Q8_0)),
    "qwen2-Q8_0": ("qwen2", dict.fromkeys(MATRICES, Q.Q8_0)),
    "llama-Q4_0": ("llama", dict.fromkeys(MATRICES, Q.Q4_0)),
    "qwen2-Q5_0": ("qwen2", dict.fromkeys(MATRICES, Q.Q5_0)),
    "qwen2-mixed": ("qwen2", MIXED),
}
#: Most a layer's output may be off the dense layer's on the same int8 inputs, relative to
#: sum_k |x^_k w_k|: test_quant_linear's AVX2 bound (the looser of the two paths).
LAYER_BOUND = 8e-5
#: Most a prompt position's logits may be off the reference's (below), relative to the
#: largest logit. The reference quantizes each linear's input exactly as the kernels do, but
#: its own float32 sums (a GEMM's order) differ from the kernels' by ~1e-7: an input within
#: that of a rounding boundary of its int8 grid rounds the other way, moving by one step
#: (1/127 of its block's largest value), and that shows in the logits (and, through the KV
#: cache, at later positions). Most positions agree to ~3e-7; with such flips, measured up to
#: 2e-2 (one type) and 3.2e-2 (MIXED) over 4 seeds x these 5 models on both paths (VNNI,
#: AVX2). A wrong weight anywhere (rows, permutation, bias, part order) moves them by O(1).
LOGIT_BOUND = 0.08


def _model(tmp_path: Path, name: str, seed: int = 0) -> Path:
    arch, types = MODELS[name]
    path = tmp_path / f"{name}.gguf"
    _write(path, _state(arch, seed), arch, types)
    return path


def _engine(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), kv_cache_memory="16MiB", max_model_len=256, **kwargs)


def _kept_in_float32(path: Path) -> LLM:
    """An engine over the GGUF's blocks kept as they are (``gguf_blocks="native"``), with
    float32 activations: the block kernels' arithmetic without bf16 rounding around it."""
    return _engine(path, dtype="float32", gguf_blocks="native")


def _int8_inputs(self: TorchLinear, x: torch.Tensor) -> torch.Tensor:
    """``TorchLinear.__call__`` with x quantized exactly as the block kernels quantize it for
    each part of the layer (``quantize_activations``, per 32 inputs or, for the K-quants on
    AVX2, per 256 and 32: the native layer's ``activation_parts``, copied to the dense one as
    ``act_parts``; per 32 for a layer without them; the values rounded back to float32)."""
    parts = getattr(self, "act_parts", ((self.weight.shape[0], 32),))
    flat = x.reshape(-1, x.shape[-1]).float()
    outs, at = [], 0
    for rows, block in parts:
        xq = quantize_activations(flat, block).to(x.dtype).reshape(x.shape)
        bias = self.bias[at : at + rows] if self.bias is not None else None
        outs.append(F.linear(xq, self.weight[at : at + rows], bias))
        at += rows
    return torch.cat(outs, dim=-1)


def _quantized_sizes(x: torch.Tensor, w: torch.Tensor,
                     parts: tuple[tuple[int, int], ...]) -> torch.Tensor:  # fmt: skip
    """S = sum_k |x^_k w_k| [M, N] with x quantized as each part's kernel quantizes it."""
    sizes, at = [], 0
    for rows, block in parts:
        xq = quantize_activations(x, block)
        sizes.append(xq.abs() @ w[at : at + rows].double().abs().T)
        at += rows
    return torch.cat(sizes, dim=1)


def _prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), V] of one prefill of ``ids`` (an idle engine's cache), its
    rows prompt tokens as the engine runs them (bf16 tiles where ``prompt_tiles``)."""
    eng = llm.engine
    n, bs = len(ids), eng.config.block_size
    meta = one_prefill(n, bs)
    roles = RowRoles.of([True] * n) if eng.model.prompt_tiles else None
    with torch.no_grad():
        ids_t, caches = torch.tensor(ids), eng.runner.kv_caches
        hidden = eng.model.forward(ids_t, torch.arange(n), caches, meta, roles)
        return eng.model.compute_logits(hidden).float()


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # the 6 ordinary tokens of the vocabulary
    return [[rng.randrange(2, len(TOKENS)) for _ in range(n)] for n in (1, 9, 40, 120)]


@pytest.fixture
def quant_kernels() -> None:
    if load_quant_lib() is None:
        pytest.skip("no block-format kernels here (no C compiler, or a generic build)")


def _layers(llm: LLM) -> list[tuple[str, Any]]:
    model = llm.engine.model
    named = [("lm_head", model.lm_head.layer)]
    for i, layer in enumerate(model.layers):
        named += [(f"{i}.{a}", getattr(layer, a)) for a in ("qkv", "o", "gate_up", "down")]
    return named


@pytest.mark.usefixtures("quant_kernels")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_block_quantized_model_runs_natively_as_its_dequantized_self(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file run on its blocks (QuantLinear for every layer and the head, QuantEmbedding)
    against the same file dequantized in float32, each linear's input quantized per 32
    exactly as the kernels do (``_int8_inputs``): layer by layer on the same inputs, within
    the kernels' rounding; the prompts' logits within LOGIT_BOUND; and greedy decoding
    token for token wherever the reference's top two logits are further apart than twice
    that (closer, a rounding flip may rightly pick the other; the sequences may part there).

    Against the plain float32 model the logits move by the int8 rounding itself (a few
    percent on these models; the dtype-auto test below)."""
    path = _model(tmp_path, name)
    native = _kept_in_float32(path)
    model = native.engine.model
    assert isinstance(model.embed, QuantEmbedding)
    assert isinstance(model.lm_head.layer, QuantLinear) and model.lm_head.float32_sums
    # the types of the layers' matrices (the embedding's is not a layer's)
    types = {
        t.name
        for m, t in MODELS[name][1].items()
        if t in NATIVE_QTYPES and m != "token_embd.weight"
    }
    assert native.engine.build_info["linear"].startswith("+".join(sorted(types)) + "-")

    monkeypatch.setattr(TorchLinear, "__call__", _int8_inputs)
    reference = _engine(path, dtype="float32")
    assert reference.engine.build_info["linear"] == "torch-float32"

    g = torch.Generator().manual_seed(0)
    for (where, layer), (_, dense) in zip(_layers(native), _layers(reference), strict=True):
        assert isinstance(dense, TorchLinear), where
        if name == "qwen2-mixed" and where in ("1.gate_up", "1.o"):  # Q2_K gate, F16 o
            assert isinstance(layer, TorchLinear) and torch.equal(layer.weight, dense.weight)
            continue
        assert isinstance(layer, QuantLinear), where
        dense.act_parts = layer.activation_parts  # type: ignore[attr-defined]
        x = torch.randn(5, dense.weight.shape[1], generator=g)
        size = _quantized_sizes(x, dense.weight, layer.activation_parts)
        err = (layer(x).double() - dense(x).double()).abs()
        assert (err <= LAYER_BOUND * size + 1e-6).all(), where

    for ids in _prompts(5):
        got, want = _prompt_logits(native, ids), _prompt_logits(reference, ids)
        assert (got - want).abs().max() <= LOGIT_BOUND * want.abs().max()

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = _prompts(6)
    compared = 0
    outs = zip(reference.generate(prompts, greedy), native.generate(prompts, greedy), strict=True)
    for expected, out in outs:
        scale = max(abs(lp) for step in expected.logprobs for _, lp in step.top_logprobs)
        for k, step in enumerate(expected.logprobs):  # raw logits, most likely first
            compared += 1  # the same tokens so far: the same context
            if out.token_ids[k] != expected.token_ids[k]:
                (_, first), (_, second) = step.top_logprobs
                assert first - second <= 2 * LOGIT_BOUND * scale, (k, expected, out)
                break
    # measured: 9 of 160 sequences (4 seeds x 5 models x 2 paths x 4 prompts) parted, each
    # where the top two were within 1.3% of the largest logit
    assert compared >= 24


@pytest.mark.usefixtures("quant_kernels")
@pytest.mark.parametrize("name", ["llama-Q8_0", "qwen2-Q5_0"])
def test_dtype_auto_keeps_the_blocks_and_stays_near_float32(name: str, tmp_path: Path) -> None:
    """The engine's default (dtype auto, no quantization asked) runs the blocks natively,
    with bf16 activations where the CPU has a native bf16 linear. Against the file
    dequantized in float32 the logits move by bf16 and int8 rounding together: measured
    2-4.8% of the largest logit, the argmax kept at 93-100% of prompt positions (4 seeds x
    the 5 models, both paths); bounds 10% and 85%."""
    path = _model(tmp_path, name)
    # tiny models are below the size where auto keeps blocks (test_precision.py): asked for
    auto = _engine(path, gguf_blocks="native")
    assert auto.engine.config.dtype == "auto"
    qtype = MODELS[name][1]["attn_q.weight"].name
    assert auto.engine.build_info["linear"].startswith(f"{qtype}-")
    assert isinstance(auto.engine.model.embed, QuantEmbedding)
    reference = _engine(path, dtype="float32")
    agree, total = 0, 0
    for ids in _prompts(5)[1:]:
        got, want = _prompt_logits(auto, ids), _prompt_logits(reference, ids)
        assert (got - want).abs().max() <= 0.1 * want.abs().max()
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree >= 0.85 * total
