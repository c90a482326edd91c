"""The torch attention backend's prefill paths against plain causal attention (with the native
softmax or without, with bf16 matmuls or computed in float32 where those are slow)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgate.model.attention import PrefillSlice, TorchAttention
from kvgate.model.cpu_kernels import load_paged_decode


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention in float64: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1),
        is_causal=True, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("length", [200, 256, 257, 300, 512, 513, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prompt_is_causal_attention_on_every_path(length: int, dtype: torch.dtype) -> None:
    """Up to 256 tokens: the short path; up to 512: its first 256 queries there and the
    rest as a chunk that sees them; beyond: SDPA whole. Each is causal attention."""
    heads, kv_heads, d = 9, 3, 64
    torch.manual_seed(length)
    q = torch.randn(length, heads, d).to(dtype)
    k = torch.randn(length, kv_heads, d).to(dtype)
    v = torch.randn(length, kv_heads, d).to(dtype)
    # The prompt sits after another sequence's rows in the flat batch.
    pad = 3
    qb, kb, vb = (torch.cat([torch.zeros(pad, *t.shape[1:], dtype=dtype), t]) for t in (q, k, v))
    p = PrefillSlice(pad, pad + length, start_pos=0, block_table=torch.zeros(1, dtype=torch.long))
    empty = torch.empty(0, dtype=dtype)
    exact = _causal(q, k, v)
    for kernel, upcast in ((None, False), (load_paged_decode(), False), (None, True)):
        attention = TorchAttention(heads, kv_heads, d, kernel, upcast=upcast)
        got = attention._prefill(qb, kb, vb, empty, empty, p)
        assert got.shape == (length, heads, d)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        else:  # bf16 scores and probabilities on the short path: bf16-sized errors
            torch.testing.assert_close(got.double(), exact, atol=3e-2, rtol=3e-2)
