"""K/V stored otherwise than computed (``--kv-cache-dtype``): int8 and fp8 rows with a scale
each, within their bounds; attention over them equal to attention over the decoded values;
the same prompt whole, chunked and from a prefix hit gives the same tokens; the pool holds
more tokens in the same bytes."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kvgate import SamplingParams
from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.entrypoints.llm import LLM
from kvgate.errors import InvalidConfig
from kvgate.model.attention import AttentionMetadata, TorchAttention
from kvgate.model.cpu_kernels import load_fused_ops_lib
from kvgate.model.kv_codec import KVCodec, codec_for, key_offset
from tests.model.isa import vector_levels
from tests.model.steps import one_prefill

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_come_back_within_the_formats_bound(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=g) * torch.rand(50, 4, 1, generator=g) * 10
    x[3, 2] = 0.0  # an all-zero row keeps a scale of 1 and comes back zero
    x[7, 1, 5] = 300.0  # an outlier costs only its own row its precision
    x = x.to(dtype)
    codec = KVCodec(name, dtype)
    rows = codec.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 4, 64 + 2 * 4)  # 2 scales a row
    back = codec.decode(rows, 64)
    assert back.dtype == dtype and back.shape == x.shape
    xf, err = x.float(), (back.float() - x.float()).abs()
    groups = xf.view(50, 4, 2, 32).abs().amax(-1, keepdim=True)  # a scale per 32 values
    scale = groups.expand(50, 4, 2, 32).reshape(50, 4, 64) / (127 if name == "int8" else 448)
    # int8: rounding to the nearest step of the row's scale; e4m3: 3 mantissa bits (half
    # an ulp, 2^-4 relative), subnormals below 2^-6.
    half_step = scale / 2
    bound = half_step if name == "int8" else xf.abs() * 2**-4 + scale * 2**-9
    slack = 2**-7 if dtype == torch.bfloat16 else 1e-6  # the cast back to the model's dtype
    assert bool((err <= bound * 1.0001 + xf.abs() * slack + 1e-12).all())
    assert bool((back[3, 2] == 0).all())
    if name == "int8":  # the outlier's 32 values lost precision; the row's other 32 did not
        assert err[7, 1, 32:].max() < err[7, 1, :32].max() / 10
    assert torch.equal(codec.roundtrip(back), back)  # decoded rows are stored exactly again


def test_a_dtype_stored_as_computed_needs_no_codec() -> None:
    assert codec_for("bfloat16", torch.bfloat16) is None
    assert codec_for("int8", torch.bfloat16) is not None
    cast = codec_for("bfloat16", torch.float32)
    assert cast is not None and cast.row_width(64) == 64
    with pytest.raises(InvalidConfig, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("name", ["int8", "fp8", "bfloat16"])
def test_attention_reads_the_decoded_rows(name: str) -> None:
    """A chunk after a cached prefix and a decode over stored rows equal attention in the
    model's dtype over what the rows decode to; a fresh prompt attends over the same."""
    torch.manual_seed(1)
    hq, hkv, d, bs, n = 4, 2, 16, 4, 10
    codec = codec_for(name, torch.float32)
    attn = TorchAttention(hq, hkv, d, codec=codec)
    plain = TorchAttention(hq, hkv, d)
    num_blocks = 8
    caches = [
        torch.zeros(attn.kv_cache_shape(num_blocks, bs), dtype=attn.kv_dtype),
        torch.zeros(attn.v_cache_shape(num_blocks, bs), dtype=attn.kv_dtype),
    ]
    plain_caches = [torch.zeros(plain.kv_cache_shape(num_blocks, bs)) for _ in range(2)]
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    assert codec is not None
    k_rt, v_rt = codec.roundtrip(k), codec.roundtrip(v)
    meta = one_prefill(n, bs)
    attn.write_kv(k, v, *caches, meta)
    plain.write_kv(k_rt, v_rt, *plain_caches, meta)
    fresh = attn.attend(q, k, v, *caches, meta)
    want = plain.attend(q, k_rt, v_rt, *plain_caches, meta)
    torch.testing.assert_close(fresh, want, rtol=0, atol=0)
    # One decode more, reading every row from the pool.
    q1, k1, v1 = torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    step = AttentionMetadata(
        slot_mapping=torch.tensor([n]),
        num_decodes=1,
        decode_blocks=torch.arange(-(-(n + 1) // bs)),
        decode_lens=torch.tensor([n + 1]),
        prefills=(),
    )
    attn.write_kv(k1, v1, *caches, step)
    plain.write_kv(codec.roundtrip(k1), codec.roundtrip(v1), *plain_caches, step)
    got = attn.attend(q1, k1, v1, *caches, step)
    torch.testing.assert_close(got, plain.attend(q1, k1, v1, *plain_caches, step), rtol=0, atol=0)
    # Against unquantized K/V: close, not equal.
    exact = plain.attend(q, k, v, *[torch.zeros_like(c) for c in plain_caches], meta)
    tol = {"int8": 0.05, "fp8": 0.15, "bfloat16": 0.02}[name]
    assert (fresh - exact).abs().max() < tol


def _attention(keys: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query [Hkv, D] over keys and values [L, Hkv, D], float64: [Hkv, D]."""
    w = torch.softmax(torch.einsum("hd,lhd->hl", q, keys) / q.shape[-1] ** 0.5, dim=-1)
    return torch.einsum("hl,lhd->hd", w, v)


def test_the_key_offset_is_the_bias_on_the_channels_rope_hardly_turns() -> None:
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, 16, 2).float() / 16)  # [8]: 1 ... 3.2e-4
    bias = torch.randn(2 * 16) * 100
    offset = key_offset(bias, inv_freq, 2048)  # only pair 7 turns <= 1 rad over 2048
    assert offset is not None and offset.shape == (2, 16) and offset.dtype == torch.float32
    unturned = torch.zeros(16, dtype=torch.bool)
    unturned[[7, 15]] = True  # rotate-half pairs: channels j and j + D/2
    assert torch.equal(offset[:, unturned], bias.view(2, 16)[:, unturned])
    assert bool((offset[:, ~unturned] == 0).all())
    assert key_offset(bias, inv_freq, 100_000) is None  # every pair turns over that context
    assert key_offset(torch.zeros(32), inv_freq, 2048) is None


def test_keys_less_a_constant_leave_attention_as_it_is_and_keep_their_precision() -> None:
    """Why quantized keys are stored less ``key_offset``: exact without quantization (every
    score of a query moves by ``q . offset``), and where a key bias puts several channels of
    a scale group at ~100x the rest (as Qwen2.5's does), the group's scale is set by the
    largest and e4m3 keeps 1/16 of the others' size as error, int8 1/254 of the largest:
    the scores' error (what softmax sees of it: less its mean over the keys) is ~10x
    smaller with the offset."""
    g = torch.Generator().manual_seed(4)
    length, hkv, d = 300, 2, 64
    f64 = torch.float64
    keys = torch.randn(length, hkv, d, generator=g, dtype=f64) * 2
    channels = [28, 29, 30, 31, 60, 61, 62, 63]  # the last of each half: RoPE's slowest
    bias = torch.zeros(hkv, d, dtype=f64)
    bias[:, channels] = torch.tensor(
        [[60, -90, 150, 350, -40, 70, -130, -290], [30, 50, -70, 110, 20, -40, 60, 80]], dtype=f64
    )
    keys[:, :, channels] *= 3  # the bias channels vary more from token to token, too
    keys += bias
    q = torch.randn(hkv, d, generator=g, dtype=f64)
    v = torch.randn(length, hkv, d, generator=g, dtype=f64)
    torch.testing.assert_close(
        _attention(keys - bias, q, v), _attention(keys, q, v), rtol=1e-9, atol=1e-12
    )
    exact = torch.einsum("hd,lhd->hl", q, keys)

    def error(name: str, offset: torch.Tensor) -> float:
        stored = KVCodec(name, torch.float32).roundtrip((keys - offset).float()).double()
        err = torch.einsum("hd,lhd->hl", q, stored) - exact
        return float((err - err.mean(-1, keepdim=True)).std())

    none = torch.zeros_like(bias)
    for name in ("int8", "fp8"):
        assert error(name, bias) < error(name, none) / 4, name
    assert error("fp8", none) > 1.0  # about one logit of noise on every score


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_the_same_prompt_scheduled_otherwise_gives_the_same_tokens(
    name: str, model: str, request: pytest.FixtureRequest
) -> None:
    """Whole, in chunks of 5 tokens, batched, and continued from a prefix hit: every path
    attends over the quantized rows, so none differs from another (keys less the Qwen2's
    key offset on every path too)."""
    tiny_llama_dir: Path = request.getfixturevalue(model)
    if model == "tiny_qwen2_dir":
        probe = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype=name)
        assert all(layer.key_offset is not None for layer in probe.engine.model.layers)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40 + 9 * i)] for i in range(3)]
    whole = LLM(
        str(tiny_llama_dir), dtype="float32", kv_cache_dtype=name, enable_prefix_caching=False
    )
    want = [_greedy(whole, [p])[0] for p in prompts]
    chunked = LLM(
        str(tiny_llama_dir), dtype="float32", kv_cache_dtype=name, max_num_batched_tokens=5
    )
    assert _greedy(chunked, prompts) == want
    out = chunked.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.num_cached_tokens >= 48  # continued from the prefix the batch cached
    assert list(out.token_ids) == want[2]
    assert chunked.engine.build_info["kv_dtype"] == name


def test_the_pool_holds_more_tokens_in_the_same_bytes(tiny_llama_dir: Path) -> None:
    decode: dict[str, str] = {}

    def tokens(kv: str) -> int:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                dtype="bfloat16",
                kv_cache_dtype=kv,
                kv_cache_memory="8MiB",
            )
        )
        decode[kv] = engine.build_info["decode"]
        return engine.kv_pool.num_tokens

    bf16, int8 = tokens("auto"), tokens("int8")
    # The whole native decode layers read quantized rows as they read bf16 ones.
    assert decode["int8"] == decode["auto"]
    head_dim = 16  # the tiny Llama's: a row is 16 bytes and one 4-byte scale, against 32
    assert int8 / bf16 == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.01)


def test_a_preempted_and_recomputed_prompt_reads_the_same_rows(tiny_llama_dir: Path) -> None:
    """int8 rows under a pool too small for the batch: preempted sequences recompute to the
    tokens they give alone."""
    prompts = [[(11 * i + j) % 700 + 3 for j in range(60 + 13 * i)] for i in range(4)]
    alone = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype="int8")
    want = [_greedy(alone, [p], 24)[0] for p in prompts]
    # A block: 16 tokens x 2 layers x (K, V) x 2 KV heads x (16 + 4) bytes = 2560.
    small = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        kv_cache_dtype="int8",
        kv_cache_memory=str(14 * 2560),
        max_model_len=160,
        max_num_batched_tokens=32,
    )
    assert small.engine.kv_pool.num_blocks == 14
    assert _greedy(small, prompts, 24) == want
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("level", vector_levels())
@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("offset", [False, True])
def test_fused_rope_write_encodes_rows_bit_identical_to_the_codec(
    level: str, name: str, offset: bool
) -> None:
    """The fused RoPE + KV write (``rope_write_kv_q8``) stores what ``KVCodec.encode`` would,
    byte for byte, on every vector level: a prompt's rows are the same whichever path wrote
    them. Rows with zeros, a negative zero, outliers, tiny values (fp8's subnormals) and
    ties; with a key offset, keys less it as the per-op path rounds them (``TorchLayerOps``)."""
    lib = load_fused_ops_lib(level)
    if lib is None:
        pytest.skip(f"no fused ops at {level} (no vector path or no compiler)")
    t, hq, hkv, d = 37, 4, 2, 64
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * torch.rand(t, 1, generator=g) * 8
    qkv[0] = 0.0
    qkv[1, :d] = -0.0
    qkv[2, hq * d + 3] = 500.0  # an outlier in a key
    qkv[3] = torch.linspace(-1e-3, 1e-3, qkv.shape[1])  # tiny beside ...
    qkv[3, hq * d] = qkv[3, (hq + hkv) * d + 40] = 100.0  # ... an outlier: fp8 subnormals
    qkv[4, hq * d : hq * d + 32] = torch.arange(32) * 0.5  # exact halves: ties
    qkv = qkv.to(torch.bfloat16)
    positions = torch.zeros(t, dtype=torch.int64)
    cos = torch.ones(1, d, dtype=torch.bfloat16)  # position 0: the rotation is the identity
    sin = torch.zeros(1, d, dtype=torch.bfloat16)
    n_slots = 64
    slots = torch.randperm(n_slots, generator=g)[:t].contiguous()
    codec = KVCodec(name, torch.bfloat16)
    width = codec.row_width(d)
    k_cache = torch.zeros(hkv, n_slots, width, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    q_out = torch.empty(t, hq, d, dtype=torch.bfloat16)
    k_out = torch.empty(t, hkv, d, dtype=torch.bfloat16)
    fn = lib.lib.rope_write_kv_q8
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 4 + [ctypes.c_int64]
    fn.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    shift = torch.randn(hkv, d, generator=g) * 50 if offset else None
    fn(
        qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        t, hq, hkv, d, n_slots, d // 32, name == "fp8", None if shift is None else shift.data_ptr(),
    )  # fmt: skip
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    if shift is not None:
        k = (k.float() - shift).to(torch.bfloat16)
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)
    assert torch.equal(k_out, k)
    assert torch.equal(k_cache[:, slots], codec.encode(k).transpose(0, 1))
    assert torch.equal(v_cache[:, slots], codec.encode(v).transpose(0, 1))
