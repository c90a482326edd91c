"""The native bf16 linear against exact arithmetic, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.model.cpu_kernels import load_linear_lib
from kvgate.model.linear import NativeCpuLinear, PackedCpuLinear, TorchLinear, make_linear

needs_kernel = pytest.mark.skipif(load_linear_lib() is None, reason="no C compiler")


def _native(weight: torch.Tensor, bias: torch.Tensor | None = None) -> NativeCpuLinear:
    lin = make_linear(weight, bias, pack=True)
    if not isinstance(lin, NativeCpuLinear):
        pytest.skip("this CPU has no AVX512-BF16: the oneDNN path is used instead")
    return lin


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (64, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_within_one_bf16_rounding_of_the_exact_product(
    out_features: int, in_features: int, with_bias: bool
) -> None:
    torch.manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if with_bias else None
    x = torch.randn(37, in_features).bfloat16()
    got = _native(w, b)(x)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    # float32 accumulation, one rounding to bf16: never more than a bf16 ulp (plus the
    # float32 sum's own error) from the exact value, and almost always the nearest bf16.
    torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=2**-7)
    assert (got == exact.bfloat16()).float().mean() > 0.995
    assert (got == F.linear(x, w, b)).float().mean() > 0.995


@needs_kernel
def test_a_row_gets_the_same_output_in_any_batch() -> None:
    """One fixed summation order per output: batching never changes a sequence's logits."""
    torch.manual_seed(3)
    lin = _native(torch.randn(3072, 576).bfloat16())
    x = torch.randn(70, 576).bfloat16()
    alone = torch.cat([lin(x[i : i + 1]) for i in range(70)])
    for m in [2, 7, 8, 9, 16, 33, 70]:
        assert torch.equal(lin(x[:m]), alone[:m])


@needs_kernel
def test_shapes_it_does_not_take_use_onednn_and_empty_batches_work() -> None:
    odd_columns = torch.randn(40, 64).bfloat16()
    assert isinstance(make_linear(odd_columns, None, pack=True), PackedCpuLinear)
    assert isinstance(make_linear(odd_columns, None, pack=True, native=False), PackedCpuLinear)
    assert isinstance(make_linear(odd_columns.float(), None, pack=False), TorchLinear)
    lin = _native(torch.randn(64, 64).bfloat16())
    assert lin(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)
