"""The encoder attention kernel (``csrc/encoder_attention.c``, the embedder's) against
PyTorch's attention in float64, on packed sequences of many lengths, at every vector path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.model.cpu_kernels import EncoderAttentionKernel, load_encoder_attention
from tests.model.isa import vector_levels, vector_path

levels = pytest.mark.parametrize("level", vector_levels())

#: Lengths around the kernels' tiles (4 and 8 queries, 16 keys) and the embedder's longest.
LENS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 129, 512]


def _kernel(level: str) -> EncoderAttentionKernel:
    kernel = load_encoder_attention(level)
    if kernel is None:
        pytest.skip("no C compiler: kernels unavailable")
    return kernel


def _reference(qkv: torch.Tensor, lens: list[int], heads: int) -> torch.Tensor:
    """Each sequence on its own through SDPA in float64: [T, heads * D]."""
    out, at = [], 0
    for n in lens:
        q, k, v = qkv[at : at + n].double().view(n, 3, heads, -1).permute(1, 2, 0, 3)
        out.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, -1))
        at += n
    return torch.cat(out)


def _starts(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)


@levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 32), (3, 64), (1, 96)])
def test_encoder_attention_matches_torch(
    level: str, dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    kernel = _kernel(level)
    assert kernel.isa == vector_path(level)
    torch.manual_seed(heads)
    qkv = (torch.randn(sum(LENS), 3 * heads * head_dim) * 2).to(dtype)
    ref = _reference(qkv, LENS, heads)
    got = kernel(qkv, _starts(LENS), heads)
    assert got.dtype == dtype and got.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, atol=5e-5, rtol=1e-4)
    else:
        # bf16: the output rounded once, and the probabilities rounded before P.V on the
        # AVX512-BF16 path; at most twice the error of PyTorch's own bf16 SDPA here.
        torch_bf16 = torch.cat(
            [F.scaled_dot_product_attention(*qkv[a:b].view(b - a, 3, heads, -1).permute(1, 2, 0, 3))
             .transpose(0, 1).reshape(b - a, -1)
             for a, b in zip(_starts(LENS)[:-1].tolist(), _starts(LENS)[1:].tolist(), strict=True)]
        )  # fmt: skip
        ours = (got.double() - ref).abs().max().item()
        theirs = (torch_bf16.double() - ref).abs().max().item()
        assert ours <= 2 * theirs, (ours, theirs)


@levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequences_attention_does_not_depend_on_its_pack(level: str, dtype: torch.dtype) -> None:
    kernel = _kernel(level)
    torch.manual_seed(1)
    qkv = torch.randn(sum(LENS), 3 * 4 * 32).to(dtype)
    together = kernel(qkv, _starts(LENS), 4)
    at = 0
    for n in LENS:
        alone = kernel(qkv[at : at + n], _starts([n]), 4)
        assert torch.equal(alone, together[at : at + n]), n
        at += n


@levels
def test_encoder_attention_refuses_what_it_cannot_take(level: str) -> None:
    kernel = _kernel(level)
    assert not kernel.supports(torch.float32, 48) and not kernel.supports(torch.float16, 32)
    assert kernel.supports(torch.bfloat16, 64)
    with pytest.raises(ValueError, match="refused"):
        kernel(torch.randn(10, 3 * 2 * 48), _starts([4, 6]), 2)
