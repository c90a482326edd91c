"""The native linears against exact arithmetic, their batch invariance, and the factory's pick,
under every kernel path this CPU can run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.model.cpu_kernels import KernelLibrary, load_linear_lib
from kvgate.model.linear import (
    BF16_DOT_ISAS,
    Bf16DotLinear,
    Linear,
    LinearFactory,
    PackedCpuLinear,
    TorchLinear,
    WidenLinear,
    dequantize_int8,
    onednn_packs,
    quantize_int8,
)
from tests.model.isa import vector_levels

CPU = torch.device("cpu")
levels = pytest.mark.parametrize("level", vector_levels())


def _library(level: str) -> KernelLibrary:
    lib = load_linear_lib(level)
    if lib is None:
        pytest.skip(f"no vector linear for {level} (no C compiler, or a generic build)")
    return lib


def _factory(
    level: str, dtype: torch.dtype = torch.bfloat16, q: str | None = None
) -> LinearFactory:
    return LinearFactory.for_device(dtype, CPU, _library(level), q)


def _native(level: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    lin = _factory(level)(weight, bias)
    assert isinstance(lin, Bf16DotLinear | WidenLinear)
    return lin


@levels
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (64, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_within_one_bf16_rounding_of_the_exact_product(
    level: str, out_features: int, in_features: int, with_bias: bool
) -> None:
    torch.manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if with_bias else None
    lin = _native(level, w, b)
    for rows in (1, 2, 3, 5, 37):
        x = torch.randn(rows, in_features).bfloat16()
        got = lin(x)
        exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
        # float32 accumulation, one rounding to bf16: never more than a bf16 ulp (plus the
        # float32 sum's own error) from the exact value, and almost always the nearest bf16.
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=2**-7)
        assert (got == exact.bfloat16()).float().mean() > 0.995
        assert (got == F.linear(x, w, b)).float().mean() > 0.99


@levels
@pytest.mark.parametrize("quantization", [None, "int8", "int8-b32"])
def test_a_row_gets_the_same_output_in_any_batch(level: str, quantization: str | None) -> None:
    """One fixed summation order per output: batching never changes a sequence's logits."""
    torch.manual_seed(3)
    lin = _factory(level, q=quantization)(torch.randn(3072, 576), None)
    assert not isinstance(lin, TorchLinear | PackedCpuLinear)
    x = torch.randn(70, 576).bfloat16()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(70)])
    for m in [2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 24, 31, 32, 33, 70]:
        assert torch.equal(lin(x[:m]), alone[:m])


@levels
@pytest.mark.parametrize("quantization", ["int8", "int8-b32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_equals_the_dequantized_weights(
    level: str, quantization: str, dtype: torch.dtype, with_bias: bool
) -> None:
    """The int8 kernel computes x (scale q)^T + b: against exact arithmetic on the
    dequantized weights, within the error of x's int16 quantization, float32 summation
    error and one rounding of the output."""
    torch.manual_seed(5)
    w = torch.randn(960, 576) * torch.logspace(-2, 1, 960)[:, None]  # rows of every scale
    w[:, 100:132] *= 20  # one block of outliers: blocks get their own scale
    b = torch.randn(960).to(dtype) if with_bias else None
    lin = _factory(level, dtype, quantization)(w, b)
    assert isinstance(lin, WidenLinear)
    q, scale = quantize_int8(w, 32 if quantization == "int8-b32" else None)
    bias_bytes = b.numel() * b.element_size() if b is not None else 0
    assert lin.weight_bytes() == q.numel() + 4 * scale.numel() + bias_bytes
    deq = dequantize_int8(q, scale).double()
    for rows in (1, 6, 29):
        x = torch.randn(rows, 576).to(dtype)
        exact = x.double() @ deq.T + (b.double() if b is not None else 0.0)
        # x goes to int16, one scale per row: each input errs by at most half a step...
        step = x.double().abs().amax(dim=1, keepdim=True) / 32767
        quantization = step / 2 * deq.abs().sum(dim=1)[None, :]
        # ...a float32 sum of K terms errs by at most ~K eps sum |terms| (a loose bound)...
        summation = 576 * 2**-24 * (x.double().abs() @ deq.abs().T) + quantization
        # ...then a bf16 output rounds once more: half an ulp, 2^-9 relative.
        rounding = exact.abs() * 2**-8 if dtype == torch.bfloat16 else 0.0
        assert ((lin(x).double() - exact).abs() <= summation + rounding + 1e-6).all()


@pytest.mark.parametrize("quantization", ["int8", "int8-b32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_with_vnni_is_bit_identical_to_avx2(quantization: str, dtype: torch.dtype) -> None:
    """The avx512bf16 build's vpdpwssd sums the same int32 integers as the avx2 build's
    vpmaddwd + vpaddd: a model's int8 outputs do not depend on which of the two runs."""
    if "avx512bf16" not in vector_levels():
        pytest.skip("this CPU has no AVX512-BF16/VNNI (the avx2 path is tested above)")
    torch.manual_seed(9)
    w = torch.randn(960, 576) * torch.logspace(-2, 1, 960)[:, None]
    vnni = _factory("avx512bf16", dtype, quantization)
    assert vnni.path == f"{quantization}-avx512vnni"
    avx2 = _factory("avx2", dtype, quantization)(w, None)
    layer = vnni(w, None)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 576).to(dtype) * 10
        assert torch.equal(layer(x), avx2(x))


@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_tiles_agree_with_vdpbf16ps_within_rounding(with_bias: bool) -> None:
    """The amx build's tiles sum in AMX's order, not vdpbf16ps's: the same products, so the
    two agree to float32 rounding before the one bf16 rounding; a layer whose K is not a
    multiple of 32 (no whole tile) runs the vdpbf16ps path itself, bit for bit."""
    if "amx" not in vector_levels():
        pytest.skip("this CPU has no AMX-BF16 (its vdpbf16ps and AVX2 paths are tested above)")
    amx, dot = _factory("amx"), _factory("avx512bf16")
    assert amx.path == "bf16-amx" and dot.path == "bf16-avx512bf16"
    torch.manual_seed(21)
    for n, k in ((960, 576), (576, 1536), (64, 96)):
        w = torch.randn(n, k).bfloat16()
        b = torch.randn(n).bfloat16() if with_bias else None
        tiles, pairs = amx(w, b), dot(w, b)
        for rows in (1, 15, 16, 17, 32, 33, 70):
            x = torch.randn(rows, k).bfloat16()
            got, ref = tiles(x), pairs(x)
            # each side is within half a bf16 ulp of its float32 sum: at most one ulp apart
            ulp = ref.float().abs() * 2**-7 + 2e-3  # (+ float32 sums of ~40 differing near 0)
            assert ((got.float() - ref.float()).abs() <= ulp).all()
            assert (got == ref).float().mean() > 0.9
    w = torch.randn(64, 48).bfloat16()  # K = 48: no whole tile of 32 inputs
    x = torch.randn(5, 48).bfloat16()
    assert torch.equal(amx(w, None)(x), dot(w, None)(x))


def test_int8_quantization_is_symmetric_per_channel() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-254.0, 127.0, 1.0]])
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [127, -64, 32]  # 63.5 rounds to even
    assert q[1].tolist() == [0, 0, 0] and scale[1] == 1.0  # an all-zero row stays exact
    assert q[2].tolist() == [-127, 64, 0] and scale[2] == 2.0
    err = (dequantize_int8(q, scale) - w).abs().max(dim=1).values
    assert (err <= scale / 2 + 1e-7).all()


def test_int8_blocks_have_a_scale_each() -> None:
    w = torch.randn(4, 64)
    w[:, 32:] *= 1000  # the second block of every row is large
    q, scale = quantize_int8(w, 32)
    assert scale.shape == (4, 2) and (scale[:, 1] > 100 * scale[:, 0]).all()
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err[:, :32] <= scale[:, :1] / 2 + 1e-7).all()  # the small block keeps its precision


@levels
def test_the_factory_picks_by_the_library_and_shape(level: str) -> None:
    lib = _library(level)
    bf16 = _factory(level)
    # Columns not a multiple of 16: no native layout, so oneDNN where it packs bf16, else torch.
    odd = bf16(torch.randn(40, 64), None)
    assert isinstance(odd, PackedCpuLinear if bf16.onednn else TorchLinear)
    expected = Bf16DotLinear if lib.isa in BF16_DOT_ISAS else WidenLinear
    assert isinstance(bf16(torch.randn(64, 64), None), expected)
    assert bf16.path == f"bf16-{lib.isa}"
    assert isinstance(_factory(level, torch.float32)(torch.randn(64, 64), None), TorchLinear)
    lin = bf16(torch.randn(64, 64), None)
    assert lin(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)


def test_without_kernels_int8_still_rounds_the_weights() -> None:
    """No compiled library: int8 falls back to the same rounded weights on PyTorch."""
    factory = LinearFactory.for_device(torch.float32, CPU, None, "int8")
    assert factory.path == "int8-dequantized-torch"
    w = torch.randn(32, 64)
    lin = factory(w, None)
    assert isinstance(lin, TorchLinear)
    q, scale = quantize_int8(w)
    assert torch.equal(lin.weight, q.float() * scale[:, None])
    blocks = LinearFactory.for_device(torch.float32, CPU, None, "int8-b32")(w, None)
    assert isinstance(blocks, TorchLinear)
    assert torch.equal(blocks.weight, dequantize_int8(*quantize_int8(w, 32)))


@levels
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_logits_head_keeps_float32_sums(level: str, quantization: str | None) -> None:
    """On either native kernel the LM head's float32 sums are its logits (not rounded to
    bf16, whose steps near 32 make greedy ties), and a row's logits do not depend on its
    batch."""
    lib = _library(level)
    torch.manual_seed(5)
    w = torch.randn(960, 576).bfloat16()
    head = _factory(level, q=quantization).logits(w)
    assert head.float32_sums
    dot = quantization is None and lib.isa in BF16_DOT_ISAS
    assert isinstance(head.layer, Bf16DotLinear if dot else WidenLinear)
    x = torch.randn(37, 576).bfloat16()
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (37, 960)
    weights = w if quantization is None else dequantize_int8(*quantize_int8(w))
    exact = x.double() @ weights.double().T
    # int8: x is quantized per row to int16 (|error| <= max|x| / 65534 per input)
    tol = 1e-4 if quantization is None else 2e-2
    torch.testing.assert_close(got.double(), exact, atol=tol, rtol=1e-5)
    assert (got != got.bfloat16().float()).float().mean() > 0.9  # not bf16 values
    if dot:  # the same sums as the bf16 layer's, before its one rounding
        assert torch.equal(got.bfloat16(), _factory(level)(w, None)(x))
    alone = torch.cat([head(x[i : i + 1]) for i in range(37)])
    assert torch.equal(got, alone)
    for m in (5, 16, 20, 32):  # one row block, two (in place on amx), and a whole block
        assert torch.equal(head(x[:m]), alone[:m])


def test_without_kernels_the_logits_head_upcasts() -> None:
    factory = LinearFactory.for_device(torch.bfloat16, CPU, None)
    w = torch.randn(64, 32)
    head = factory.logits(w)
    assert not head.float32_sums
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(head(x), F.linear(x, w.bfloat16()).float())


def test_the_packed_linear_fuses_gelu_as_gelu_after_linear() -> None:
    if not onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN does not pack bf16 weights on this CPU (or at this forced level)")
    torch.manual_seed(0)
    w, b = (torch.randn(96, 64) / 8).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    x = torch.randn(37, 64).to(torch.bfloat16)
    exact = F.gelu(F.linear(x.double(), w.double(), b.double()))
    fused = PackedCpuLinear(w, b, gelu=True)(x)
    # one bf16 rounding of the output (2^-8 relative), where F.gelu(F.linear) rounds twice
    torch.testing.assert_close(fused.double(), exact, atol=1e-2, rtol=2**-8)
    assert torch.equal(PackedCpuLinear(w, b)(x), F.linear(x, w, b))
