"""The block-format kernels (``csrc/qlinear.c`` through ``quant_linear.py``) against exact
arithmetic, under every vector path this CPU can run: the product of the dequantized weights
with x quantized per 32 inputs as the kernel does, batch invariance, odd shapes, layers of
several parts, embedding rows, refusals, and the factory's pick."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgate.model.cpu_kernels import KernelLibrary, load_quant_lib
from kvgate.model.linear import (
    BF16_DOT_ISAS,
    LinearFactory,
    LogitsHead,
    _log_fallback,
    quant_path,
)
from kvgate.model.quant_linear import QuantEmbedding, QuantLinear, activation_block, native_qtype
from kvgate.model.quant_tensor import QuantTensor, quantize_q8_0
from tests.model.isa import vector_levels
from tests.model.quant_blocks import QTYPES, activation_steps, quantize_activations, random_quant

CPU = torch.device("cpu")
Q = GGMLQuantizationType
#: Every vector level this CPU runs (an AVX2-only machine: avx2 alone); ``generic`` has none.
LEVELS = [lv for lv in vector_levels() if lv != "generic"]
levels = pytest.mark.parametrize("level", LEVELS)
qtypes = pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
IO_DTYPES = pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16], ids=str)

#: The kernels' float32 error against the exactly quantized product (float64). The integer
#: dot products are exact; what is left is float32 rounding (u = 2^-24) of the ~K/16 scaled
#: group sums and K/16 offset terms, and those terms are larger than the products x_k w_k they
#: stand for: every weight is split as w = ws q + wo (q up to 255; wo = -8 d, -128 d,
#: -dmin m, ...), so |ws q| + |wo| is ~4 |w| on average for the 4-bit types, and AVX2, which
#: multiplies q - 128 and moves + 128 ws into the offsets, inflates them ~16x more (not Q8_0,
#: whose q - 128 is its own int8). Hence, per output, relative to S = sum_k |x^_k w_k| (not to
#: |y|, which can be near zero while its terms are not): a few u x the inflation; measured at
#: most 4.3e-7 (VNNI) and 1.1e-5 (AVX2, Q4_0) over all eight types, K 32..2048, x of scale
#: 0.01..100 with outliers and zero blocks. Bounds: ~7x that.
VNNI_TERM_BOUND = 3e-6
AVX2_TERM_BOUND = 8e-5
#: The same as max |y - ref| / max |ref| over a layer of 37 outputs x 7 rows (max |ref| is
#: then ~ S / sqrt(K) x a few): measured at most 1.4e-6 (VNNI) and 1.6e-5 (AVX2). Bounds: ~6x.
VNNI_BOUND = 8e-6
AVX2_BOUND = 1.2e-4


def _library(level: str) -> KernelLibrary:
    lib = load_quant_lib(level)
    if lib is None:
        pytest.skip(f"no block-format kernels for {level} (no C compiler)")
    return lib


def _vnni(lib: KernelLibrary) -> bool:
    return lib.isa in BF16_DOT_ISAS


def _bound(lib: KernelLibrary) -> float:
    return VNNI_BOUND if _vnni(lib) else AVX2_BOUND


def _quantized(lib: KernelLibrary, x: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """x as ``lib`` multiplies it with ``qtype`` columns: int8 per block of 32 inputs (of 256
    for the K-quants on AVX2), float64."""
    return quantize_activations(x.float(), activation_block(lib, qtype))


def _exact(lib: KernelLibrary, x: torch.Tensor,
           parts: list[QuantTensor]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The exact product [M, N] of x quantized as the kernel quantizes it for each part with
    the parts' dequantized weights (float64), and the most each float32 output may be off it:
    the term bound times S = sum_k |x^_k w_k|."""
    term = VNNI_TERM_BOUND if _vnni(lib) else AVX2_TERM_BOUND
    refs, slacks = [], []
    for p in parts:
        xq, wd = _quantized(lib, x, p.qtype), p.dequantize().double()
        refs.append(xq @ wd.T)
        slacks.append(term * (xq.abs() @ wd.abs().T))
    return torch.cat(refs, dim=1), torch.cat(slacks, dim=1)


def _assert_near(lib: KernelLibrary, y: torch.Tensor, x: torch.Tensor, parts: list[QuantTensor],
                 bias: torch.Tensor | None = None) -> None:  # fmt: skip
    ref, bound = _exact(lib, x, parts)
    ref = ref + (bias.double() if bias is not None else 0.0)
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), float((err / bound).max())


def _inputs(m: int, k: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, :5] *= 30  # outliers: one block's scale far from the others'
    return x


def _k_values(qtype: GGMLQuantizationType) -> list[int]:
    """Inputs per row: blocks of 256 for K-quants; for the 32-input types, K % 64 == 32
    (a 32-input tail after the last whole 64: the VNNI step) and a single block."""
    return [256, 768] if qtype.name.endswith("_K") else [32, 96, 800]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


@levels
@qtypes
@IO_DTYPES
def test_equals_the_exactly_quantized_product(
    level: str, qtype: GGMLQuantizationType, io_dtype: torch.dtype
) -> None:
    """float32 sums within the rounding bound of (x quantized per 32 as the kernel does, per
    256 for the K-quants on AVX2) @ (the dequantized weights)^T in float64; io-dtype outputs
    are those sums rounded once."""
    lib = _library(level)
    for k in _k_values(qtype):
        w = random_quant(qtype, 37, k, seed=k + int(qtype))
        x = _inputs(7, k, seed=k).to(io_dtype)
        ref, slack = _exact(lib, x, [w])
        sums = QuantLinear([w], None, lib, io_dtype=io_dtype, float32_out=True)(x)
        assert sums.dtype == torch.float32 and sums.shape == (7, 37)
        assert _rel_err(sums, ref) < _bound(lib), (k, _rel_err(sums, ref))
        _assert_near(lib, sums, x, [w])

        out = QuantLinear([w], None, lib, io_dtype=io_dtype)(x)
        assert out.dtype == io_dtype
        # the same float32 sum, rounded once to nearest even (as torch rounds)
        assert torch.equal(out, sums.to(io_dtype))
        if io_dtype == torch.bfloat16:  # within one bf16 rounding of the reference
            assert ((out.double() - ref).abs() <= ref.abs() * 2.0**-8 + slack).all()


@levels
@qtypes
@IO_DTYPES
def test_int8_activations_stay_within_their_rounding(
    level: str, qtype: GGMLQuantizationType, io_dtype: torch.dtype
) -> None:
    """Against plain x @ W^T (x not quantized): each input moves by at most half its block's
    step when rounded to int8 (dx = max |x| / 127 per 32 inputs, or two levels per 256 and 32:
    ``activation_steps``), so |y - x W^T| <= sum_k |w_k| dx_k / 2 for
    each output (plus the float32 rounding above): a bound per output, not a guess. It comes
    to a few percent of max |y| (measured up to 2.7% with outliers in x)."""
    lib = _library(level)
    k = 768
    w = random_quant(qtype, 37, k, seed=int(qtype))
    wd = w.dequantize().double()
    x = _inputs(9, k, seed=11).to(io_dtype)
    xf = x.double()
    y = QuantLinear([w], None, lib, io_dtype=io_dtype, float32_out=True)(x).double()
    plain = xf @ wd.T
    block = activation_block(lib, qtype)
    half_steps = activation_steps(x.float(), block)[1] / 2 * (1 + 1e-3)  # [M, K]
    bound = half_steps @ wd.abs().T + _exact(lib, x, [w])[1]
    assert ((y - plain).abs() <= bound).all()
    assert _rel_err(y, plain) < 0.05


@levels
@qtypes
@IO_DTYPES
def test_a_row_gets_the_same_output_in_any_batch(
    level: str, qtype: GGMLQuantizationType, io_dtype: torch.dtype
) -> None:
    """K = 16384: the kernel takes rows in blocks of 8 MiB / K = 512 of int8 x, so a batch
    of 517 spans two row blocks and a partial tile; every row's output is bit-identical alone,
    in batches of 1..9 starting anywhere, and in the batch of 517."""
    lib = _library(level)
    k, m = 16384, 517
    assert (8 << 20) // k < m and m % 4
    lin = QuantLinear([random_quant(qtype, 37, k, seed=3)], None, lib, io_dtype=io_dtype)
    x = _inputs(m, k, seed=5).to(io_dtype)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(m)])
    assert torch.equal(lin(x), alone)
    for size in range(1, 10):
        for start in (0, 3, m - size):
            assert torch.equal(lin(x[start : start + size]), alone[start : start + size])
    assert torch.equal(lin(x[0:0]), torch.empty(0, 37, dtype=io_dtype))


@levels
@qtypes
def test_column_counts_off_the_tile_and_input_tails(
    level: str, qtype: GGMLQuantizationType
) -> None:
    """N = 1, 3, 5, 16, 17 and 37 (AVX2 tiles of 2 columns, VNNI panels of 16, two at a
    time: partial panels, one whole, a whole and a partial one), 1..5 rows (every tile
    height): each column is the one the 37-column layer computes, within the bound of the
    exact product; K with a 32-input tail for the 32-input types."""
    lib = _library(level)
    k = _k_values(qtype)[-1]
    w = random_quant(qtype, 37, k, seed=int(qtype) + 1)
    x = _inputs(5, k, seed=2).bfloat16()
    full = QuantLinear([w], None, lib, io_dtype=torch.bfloat16, float32_out=True)(x)
    for n in (1, 3, 5, 16, 17, 37):
        head = w.take_rows(torch.arange(n))
        lin = QuantLinear([head], None, lib, io_dtype=torch.bfloat16, float32_out=True)
        for m in range(1, 6):
            y = lin(x[:m])
            assert y.shape == (m, n)
            assert torch.equal(y, full[:m, :n])
            _assert_near(lib, y, x[:m], [head])


@levels
@pytest.mark.parametrize(
    ("types", "k"),
    [((Q.Q4_K, Q.Q4_K, Q.Q6_K), 512), ((Q.Q8_0, Q.Q4_0, Q.Q5_1), 96)],
    ids=["q4k-q4k-q6k", "q8_0-q4_0-q5_1"],
)
def test_a_layer_of_parts_in_different_types_equals_their_concatenation(
    level: str, types: tuple[GGMLQuantizationType, ...], k: int
) -> None:
    """q, k and v (a Q4_K_M file keeps some in Q6_K) as one layer over the three tensors'
    own blocks, with a bias: bit-identical to each part alone, concatenated, and each row
    alone to the batch (with 16, 8 and 29 rows, the VNNI path's panels of 16 are whole runs of
    one part, straddle two parts, and end partial; the first two, side by side in one tile,
    take their float steps per 32 and per 16 inputs: Q6_K's scales are per 16)."""
    lib = _library(level)
    parts = [random_quant(t, n, k, seed=i, name=f"p{i}") for i, (t, n) in
             enumerate(zip(types, (16, 8, 29), strict=True))]  # fmt: skip
    bias = torch.randn(53, generator=torch.Generator().manual_seed(1))
    x = _inputs(6, k, seed=4).bfloat16()
    for out32 in (True, False):
        fused = QuantLinear(parts, bias, lib, io_dtype=torch.bfloat16, float32_out=out32)
        assert fused.out_features == 53 and fused.in_features == k
        assert fused.qtypes == tuple(t.name for t in types)
        assert fused.weight_bytes() == sum(p.nbytes() for p in parts) + 53 * 4
        got = fused(x)
        assert torch.equal(got, torch.cat([fused(x[i : i + 1]) for i in range(len(x))]))
        offsets = (0, 16, 24, 53)
        each = [
            QuantLinear([p], bias[a:b], lib, io_dtype=torch.bfloat16, float32_out=out32)(x)
            for p, a, b in zip(parts, offsets, offsets[1:], strict=False)
        ]
        assert torch.equal(got, torch.cat(each, dim=1))
        if out32:  # the bias is added to the float32 sum, as torch adds it
            plain = [QuantLinear([p], None, lib, io_dtype=torch.bfloat16, float32_out=True)(x)
                     for p in parts]  # fmt: skip
            assert torch.equal(got, torch.cat(plain, dim=1) + bias)
            _assert_near(lib, got, x, parts, bias)


@levels
@qtypes
def test_embedding_rows_equal_the_dequantized_table(
    level: str, qtype: GGMLQuantizationType
) -> None:
    lib = _library(level)
    table = random_quant(qtype, 50, 512, seed=int(qtype), name="token_embd.weight")
    values = table.dequantize()
    ids = torch.tensor([0, 49, 7, 7, 23, 1])
    emb = QuantEmbedding(table, lib, torch.float32)
    assert (emb.num_embeddings, emb.embedding_dim, emb.element_size()) == (50, 512, 4)
    assert torch.equal(emb(ids), values[ids])
    assert torch.equal(emb(torch.arange(50, dtype=torch.int32)), values)  # every row, int32
    bf16 = QuantEmbedding(table, lib, torch.bfloat16)
    rows = bf16(ids)
    assert rows.dtype == torch.bfloat16 and bf16.element_size() == 2
    assert torch.equal(rows, values[ids].bfloat16())  # rounded as torch rounds
    assert emb(torch.empty(0, dtype=torch.int64)).shape == (0, 512)
    for bad in ([50], [3, -1], [2**40]):
        with pytest.raises(IndexError, match=r"out of range 0\.\.49"):
            emb(torch.tensor(bad))


def _forged(qtype: GGMLQuantizationType, shape: tuple[int, int], data: torch.Tensor) -> QuantTensor:
    """A QuantTensor whose bytes do not fit its shape (``__post_init__`` refuses these):
    what the C side must refuse by itself."""
    t = object.__new__(QuantTensor)
    for field, value in (("qtype", qtype), ("shape", shape), ("data", data), ("name", "bad")):
        object.__setattr__(t, field, value)
    return t


def _extreme_blocks(qtype: GGMLQuantizationType, fill: int, rows: int, k: int) -> QuantTensor:
    """Every block of ``qtype`` with its largest integer scales (and mins) and every quantized
    value the byte pattern ``fill`` gives (0xFF: Q4_K 15, Q5_K 31, Q6_K 63; 0x00: Q6_K 0,
    i.e. q - 32 = -32); the float scales 2^-20."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.full((rows * (k // block), size), fill, dtype=np.uint8)
    half = np.array([2.0**-20], dtype=np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ql [128], qh [64], int8 scales [16], f16 d
        raw[:, 192:208] = 0x80  # -128
        raw[:, 208:210] = half
    else:  # f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (all 63), [fifth bits], nibbles
        raw[:, 0:2] = raw[:, 2:4] = half
        raw[:, 4:16] = 0xFF
    return QuantTensor(qtype, (rows, k), torch.from_numpy(raw.reshape(rows, -1)), "extreme")


@levels
@pytest.mark.parametrize(
    ("qtype", "fill"),
    [(Q.Q4_K, 0xFF), (Q.Q5_K, 0xFF), (Q.Q6_K, 0xFF), (Q.Q6_K, 0x00)],
    ids=["Q4_K", "Q5_K", "Q6_K-63", "Q6_K-0"],
)
def test_k_quant_sums_at_their_extremes_stay_exact(
    level: str, qtype: GGMLQuantizationType, fill: int
) -> None:
    """The AVX2 K-quant paths sum in int16 and int32 and take their float32 steps on exact
    integer totals per 256 inputs (Q6_K per 128): the largest weights and scales against x
    of equal magnitude (every input quantized to +-127 x 32) reach each total's bound (Q5_K
    2.04e9, Q6_K 2.13e9 of 2^31; Q6_K-63 wraps its int16 partial sums on the way). A total
    that overflowed would be off by 2^32 steps; both the few-row kernels (1..8 rows) and the
    blocks of 8 columns (13 rows) stay within the rounding bound, and agree bit for bit."""
    lib = _library(level)
    k, n = 512, 16
    w = _extreme_blocks(qtype, fill, n, k)
    signs = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0])
    x = (signs[:, None] * torch.ones(13, k)).bfloat16()
    lin = QuantLinear([w], None, lib, io_dtype=torch.bfloat16, float32_out=True)
    batch = lin(x)
    _assert_near(lib, batch, x, [w])
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(13)]), batch)
    assert torch.equal(lin(x[:8]), batch[:8])


@levels
def test_inconsistent_weights_are_refused_not_crashed_on(level: str) -> None:
    lib = _library(level)
    x = torch.randn(3, 64)

    def call(parts: list[QuantTensor]) -> None:
        QuantLinear(parts, None, lib, io_dtype=torch.float32)(x[:, : parts[0].shape[1]])

    good = random_quant(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match=r"refused"):  # K = 48: not a multiple of 32
        call([_forged(Q.Q8_0, (4, 48), torch.zeros(4, 51, dtype=torch.uint8))])
    with pytest.raises(ValueError, match=r"refused"):  # rows of 67 bytes for 2 blocks of 34
        call([_forged(Q.Q8_0, (4, 64), torch.zeros(4, 67, dtype=torch.uint8))])
    with pytest.raises(ValueError, match=r"refused"):  # K = 64 in blocks of 256
        call([_forged(Q.Q4_K, (4, 64), torch.zeros(4, 36, dtype=torch.uint8))])
    q2k = QuantTensor(Q.Q2_K, (2, 256), torch.zeros(2, 84, dtype=torch.uint8), "q2k")
    assert not native_qtype(lib, q2k) and native_qtype(lib, good)
    with pytest.raises(ValueError, match=r"refused"):  # a type the library does not know
        call([q2k])
    with pytest.raises(ValueError, match=r"inputs"):  # parts of different K
        QuantLinear([good, random_quant(Q.Q8_0, 2, 96)], None, lib, io_dtype=torch.float32)

    lin = QuantLinear([good], None, lib, io_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"float32 activations"):
        lin(x.bfloat16())
    # N that the segments' rows do not add up to, K that is not the weight's: refused in C
    y = torch.empty(3, 5)
    for n, k in ((5, 64), (3, 64), (4, 32), (4, 48), (4, 0), (0, 64)):
        rc = lin._fn(x.data_ptr(), lin._weight, None, None, y.data_ptr(), 3, n, k, 1, 0)
        assert rc == -1, (n, k)
    assert lin._fn(x.data_ptr(), lin._weight, None, None, y.data_ptr(), 0, 4, 64, 1, 0) == -1
    assert lin._fn(x.data_ptr(), lin._weight, None, None, y.data_ptr(), 3, 4, 64, 1, 0) == 0

    emb = QuantEmbedding(good, lib, torch.float32)
    ids = torch.tensor([0, 1])
    out = torch.empty(2, 64)
    # a table the row count does not match: refused, not read past
    rc = emb._fn(emb._weight, ids.data_ptr(), 2, 5, out.data_ptr(), 0)
    assert rc == -1
    assert emb._fn(emb._weight, ids.data_ptr(), 2, 4, out.data_ptr(), 0) == 0


def _q2_k(rows: int, k: int) -> QuantTensor:
    """Random Q2_K blocks (84 B per 256 inputs: scales, 2-bit values, f16 d and dmin at
    80 and 82): a type with no native kernel."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows * k // 256, 84), dtype=np.uint8)
    raw[:, 80:84] = rng.uniform(1e-3, 1e-2, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    return QuantTensor(Q.Q2_K, (rows, k), torch.from_numpy(raw.reshape(rows, -1)), "q2k")


@levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_factory_keeps_native_blocks_and_dequantizes_the_rest(
    level: str, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    lib = _library(level)
    parts = [random_quant(Q.Q4_K, 16, 256, seed=1), random_quant(Q.Q6_K, 8, 256, seed=2)]
    bias = torch.randn(24)
    x = _inputs(5, 256, seed=8).to(dtype)

    native = LinearFactory.for_device(dtype, CPU, None, quant=lib)
    layer = native.fused(parts, bias)
    assert isinstance(layer, QuantLinear) and layer.io_dtype == dtype
    assert torch.equal(layer(x), QuantLinear(parts, bias, lib, io_dtype=dtype)(x))
    assert isinstance(native(parts[0], None), QuantLinear)  # a single tensor, by __call__
    assert native.native_qtypes == {"Q4_K", "Q6_K"}
    assert native.path == f"Q4_K+Q6_K-{quant_path(lib.isa)}"
    assert isinstance(native.embedding(parts[0]), QuantEmbedding)
    head = native.logits(parts[0])
    assert isinstance(head, LogitsHead) and head.float32_sums
    assert isinstance(head.layer, QuantLinear) and head.layer.float32_out
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 16)
    assert torch.equal(logits, QuantLinear(parts[:1], None, lib, io_dtype=dtype,
                                           float32_out=True)(x))  # fmt: skip

    # quant=None: the blocks dequantized, the layer a float one over those weights
    dense = LinearFactory.for_device(dtype, CPU, None, quant=None)
    fallback = dense.fused(parts, bias)
    assert not isinstance(fallback, QuantLinear) and not dense.native_qtypes
    weights = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(fallback(x), dense(weights, bias)(x))
    # (in bf16 the dense layer's weights are the dequantized values rounded to bf16)
    exact = x.double() @ weights.to(dtype).double().T + bias.to(dtype).double()
    torch.testing.assert_close(fallback(x).double(), exact, rtol=2**-7, atol=1e-2)
    table = dense.embedding(parts[0])
    assert torch.equal(table(torch.tensor([3, 0])), parts[0].dequantize()[[3, 0]].to(dtype))
    assert not isinstance(dense.logits(parts[0]).layer, QuantLinear)

    # a type without a native kernel in a native factory: dequantized, logged once per type
    _log_fallback.cache_clear()
    q2k = _q2_k(8, 256)
    with caplog.at_level(logging.WARNING, logger="kvgate.model.linear"):
        mixed = native.fused([parts[0], q2k], None)
        native.fused([q2k], None)
    assert not isinstance(mixed, QuantLinear)
    warnings = [r for r in caplog.records if "Q2_K" in r.getMessage()]
    assert len(warnings) == 1 and "dequantized at load" in warnings[0].getMessage()
    both = torch.cat([parts[0].dequantize(), q2k.dequantize()])
    assert torch.equal(mixed(x), native(both, None)(x))


@levels
@pytest.mark.parametrize("qtype", [t for t in QTYPES if not t.name.endswith("_K")],
                         ids=lambda t: t.name)  # fmt: skip
def test_a_row_alone_equals_its_batch_with_a_32_input_tail(
    level: str, qtype: GGMLQuantizationType
) -> None:
    """The one-row path of whole panels of a 32-input type (scales gathered 16 rows at a
    time, Q8_0's bytes read straight from the blocks) against the batched panels, with K % 64
    == 32 (the last block alone) and 48 outputs (three whole panels): bit-identical."""
    lib = _library(level)
    k, m = 1056, 6
    lin = QuantLinear([random_quant(qtype, 48, k, seed=11)], None, lib, io_dtype=torch.float32)
    x = _inputs(m, k, seed=12)
    batch = lin(x)
    for i in range(m):
        assert torch.equal(lin(x[i : i + 1]), batch[i : i + 1])


@levels
@pytest.mark.parametrize("quantization", ["int8", "int8-b32"])
def test_int8_quantization_runs_dense_weights_as_q8_0_blocks(level: str, quantization: str) -> None:
    """``--quantization int8`` on a float checkpoint: each layer's weights become Q8_0 blocks
    at load and run on the W8A8 block kernels (the same layer a GGUF's Q8_0 tensor gets);
    inputs that are not whole blocks of 32 keep the int8 ``WidenLinear`` path."""
    lib = _library(level)
    torch.manual_seed(21)
    w, bias = torch.randn(40, 96), torch.randn(40)
    factory = LinearFactory.for_device(torch.bfloat16, CPU, None, quantization, quant=lib)
    layer = factory(w, bias)
    assert isinstance(layer, QuantLinear) and layer.qtypes == ("Q8_0",)
    blocks = quantize_q8_0(w, "w")
    x = _inputs(3, 96, seed=22).to(torch.bfloat16)
    assert torch.equal(layer(x), QuantLinear([blocks], bias, lib, io_dtype=torch.bfloat16)(x))
    isa = quant_path(lib.isa)
    assert factory.path == f"{quantization}-Q8_0-{isa}"
    head = factory.logits(w)
    assert isinstance(head.layer, QuantLinear) and head.layer.float32_out
    # the fused q, k, v of a layer: one Q8_0 layer over the stacked rows
    fused = factory.fused([w[:16], w[16:]], None)
    assert isinstance(fused, QuantLinear)
    assert torch.equal(fused(x), QuantLinear([blocks], None, lib, io_dtype=torch.bfloat16)(x))
    odd = factory(torch.randn(8, 40), None)  # 40 inputs: not whole blocks
    assert not isinstance(odd, QuantLinear)


@pytest.mark.skipif("amx" not in LEVELS, reason="AMX needs a Sapphire Rapids or later Xeon")
@qtypes
def test_the_amx_tiles_equal_the_vnni_panels(qtype: GGMLQuantizationType) -> None:
    """The AMX int8 tiles (batches of 16 rows and more) take the VNNI panels' exact group
    sums through the same float32 steps in the same order: bit-identical outputs, for whole
    blocks of 16 rows, a padded last block, partial panels (37 columns), a layer whose panels
    mix Q4_K's steps per 32 and Q6_K's per 16, and both output dtypes. So a batch on the tiles
    and a row alone on the one-row path still agree."""
    amx, vnni = _library("amx"), _library("avx512bf16")
    if amx.isa != "amx":
        pytest.skip("Linux did not grant this process the AMX tile state")
    k = _k_values(qtype)[-1]
    layers = [[random_quant(qtype, 37, k, seed=int(qtype) + 7)]]
    if qtype == Q.Q6_K:
        layers.append([random_quant(t, n, k, seed=i, name=f"p{i}") for i, (t, n) in
                       enumerate(((Q.Q4_K, 16), (Q.Q4_K, 8), (Q.Q6_K, 29)))])  # fmt: skip
    for parts in layers:
        for m in (16, 21, 40):
            x = _inputs(m, k, seed=m).bfloat16()
            for out32 in (True, False):
                on = [QuantLinear(parts, None, lib, io_dtype=torch.bfloat16, float32_out=out32)
                      for lib in (amx, vnni)]  # fmt: skip
                tiles, panels = on[0](x), on[1](x)
                assert torch.equal(tiles, panels), (m, out32)
                assert torch.equal(tiles[m // 2], on[0](x[m // 2 : m // 2 + 1])[0])


#: The bf16 tiles' error against x (bf16, exact) @ the dequantized weights in float64,
#: relative to S = sum_k |x_k w_k| per output: each weight rounded once to bf16 (half an ulp,
#: 2^-9 = 2.0e-3 relative) and float32 sums over K (tdpbf16ps); measured at most 2.4e-3 over
#: the eight types, K 32..1536, x of scale 0.01..100 with outliers, 3 seeds. Bound: ~1.7x.
BF16_TILE_TERM_BOUND = 4e-3


@pytest.mark.skipif("amx" not in LEVELS, reason="AMX needs a Sapphire Rapids or later Xeon")
@qtypes
def test_prompt_tokens_on_bf16_tiles_are_near_exact_and_batch_invariant(
    qtype: GGMLQuantizationType,
) -> None:
    """``QuantLinear.prompt`` on the amx build: the blocks widened to bf16 and multiplied on
    tdpbf16ps, within bf16's rounding of the weights of the exact product with x (which it
    takes unquantized), bias added in float32; and a row's output is the same alone, in a
    block of 16 or 32, or in a padded last tile, for both output dtypes and a fused layer."""
    amx = _library("amx")
    if amx.isa != "amx":
        pytest.skip("Linux did not grant this process the AMX tile state")
    k = _k_values(qtype)[-1]
    parts = [random_quant(qtype, 37, k, seed=int(qtype) + 11)]
    if qtype == Q.Q6_K:  # a fused layer mixing K-quants, as Q4_K_M files have
        parts = [random_quant(t, n, k, seed=i, name=f"p{i}")
                 for i, (t, n) in enumerate(((Q.Q4_K, 16), (Q.Q4_K, 8), (Q.Q6_K, 29)))]  # fmt: skip
    bias = torch.randn(sum(p.shape[0] for p in parts))
    wd = torch.cat([p.dequantize() for p in parts]).double()
    x = _inputs(45, k, seed=5).bfloat16()
    for out32 in (True, False):
        layer = QuantLinear(parts, bias, amx, io_dtype=torch.bfloat16, float32_out=out32)
        assert layer.prompt_tiles
        y = layer.prompt(x)
        assert y.dtype == (torch.float32 if out32 else torch.bfloat16)
        ref = x.double() @ wd.T + bias.double()
        bound = BF16_TILE_TERM_BOUND * (x.double().abs() @ wd.abs().T) + 1e-6
        if not out32:
            bound = bound + ref.abs() * 2**-8  # the output's own rounding to bf16
        err = (y.double() - ref).abs()
        assert (err <= bound).all(), float((err / bound).max())
        for m in (1, 16, 17, 32, 33):
            assert torch.equal(layer.prompt(x[:m]), y[:m]), (m, out32)
        assert torch.equal(layer.prompt(x[40:41])[0], y[40])


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "amx"])
def test_without_tiles_the_prompt_product_is_the_ordinary_one(level: str) -> None:
    lib = _library(level)
    layer = QuantLinear([random_quant(Q.Q4_K, 20, 256)], None, lib, io_dtype=torch.bfloat16)
    assert not layer.prompt_tiles
    x = _inputs(3, 256, seed=1).bfloat16()
    assert torch.equal(layer.prompt(x), layer(x))


@pytest.mark.parametrize("level", LEVELS)
def test_both_products_write_into_rows_of_a_given_output(level: str) -> None:
    """``out=``: rows of a larger output (how RowRoles runs a step's two roles without a
    gather or scatter) get exactly what a call of their own returns; a wrong one is refused."""
    lib = _library(level)
    layer = QuantLinear([random_quant(Q.Q4_K, 40, 512)], None, lib, io_dtype=torch.bfloat16)
    x = _inputs(20, 512, seed=5).bfloat16()
    y = torch.full((20, 40), float("nan"), dtype=torch.bfloat16)
    assert layer(x[:3], out=y[:3]).data_ptr() == y.data_ptr()
    layer.prompt(x[3:], out=y[3:])
    assert torch.equal(y[:3], layer(x[:3]))
    assert torch.equal(y[3:], layer.prompt(x[3:]))
    with pytest.raises(ValueError, match="out"):
        layer(x[:3], out=y[:4])
    with pytest.raises(ValueError, match="out"):
        layer.prompt(x[:3], out=torch.empty((3, 40), dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        layer(x[:3], out=torch.empty((40, 3), dtype=torch.bfloat16).t())


@levels
@pytest.mark.parametrize(
    ("types", "k"),
    [((Q.Q4_K, Q.Q8_0, Q.Q6_K), 512), ((Q.Q4_0, Q.Q8_0, Q.Q5_1), 1056)],
    ids=["q4k-q8_0-q6k", "q4_0-q8_0-q5_1"],
)
def test_few_rows_equal_the_many_row_path_across_odd_part_boundaries(
    level: str, types: tuple[GGMLQuantizationType, ...], k: int
) -> None:
    """Parts of 7, 9 and 5 rows: a pair of columns straddles each boundary (the AVX2 block
    path shifts both columns of a pair that holds a Q8_0 one), and 1..9 rows go through the
    few-row kernels (columns decoded in registers, 4 at a time) or the block path: each row's
    outputs are bit-identical to its row in a batch of 13, with a 32-input tail for the
    32-input types."""
    lib = _library(level)
    parts = [random_quant(t, n, k, seed=20 + i, name=f"p{i}") for i, (t, n) in
             enumerate(zip(types, (7, 9, 5), strict=True))]  # fmt: skip
    bias = torch.randn(21, generator=torch.Generator().manual_seed(2))
    lin = QuantLinear(parts, bias, lib, io_dtype=torch.bfloat16, float32_out=True)
    x = _inputs(13, k, seed=6).bfloat16()
    batch = lin(x)
    for size in range(1, 10):
        for start in (0, 13 - size):
            assert torch.equal(lin(x[start : start + size]), batch[start : start + size])
    _assert_near(lib, batch, x, parts, bias)


@levels
@pytest.mark.parametrize(
    ("shapes", "k"),
    [
        (((Q.Q4_K, 32), (Q.Q6_K, 16), (Q.Q5_K, 16), (Q.Q4_K, 21), (Q.Q6_K, 27)), 768),
        (((Q.Q8_0, 32), (Q.Q4_1, 16), (Q.Q5_0, 16), (Q.Q4_0, 21), (Q.Q8_0, 27)), 800),
    ],
    ids=["k-quants", "32-input-types"],
)
def test_few_rows_on_whole_panels_equal_every_other_path(
    level: str, shapes: tuple[tuple[GGMLQuantizationType, int], ...], k: int
) -> None:
    """2..15 rows (a decode step, a speculative verification) take whole panels of one run of
    Q4_K, Q6_K, Q8_0, Q4_0 or Q4_1 decoded in registers (VNNI: qlinear_few, up to 8 rows per
    pass), and the panels that are not such runs (Q5_K, Q5_0, a panel straddling two parts)
    the other paths, with a 32-input tail for the 32-input types: each row is bit-identical
    to itself alone and in a batch of 40 (the panels, or the AMX tiles), and near the exact
    product."""
    lib = _library(level)
    parts = [random_quant(t, n, k, seed=40 + i, name=f"p{i}") for i, (t, n) in enumerate(shapes)]
    lin = QuantLinear(parts, None, lib, io_dtype=torch.bfloat16, float32_out=True)
    x = _inputs(40, k, seed=8).bfloat16()
    batch = lin(x)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(15)])
    assert torch.equal(batch[:15], alone)
    for size in range(2, 16):
        for start in (0, 40 - size):
            assert torch.equal(lin(x[start : start + size]), batch[start : start + size]), size
    _assert_near(lib, batch, x, parts)
