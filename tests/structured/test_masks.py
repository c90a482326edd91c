from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.structured.masks import apply_masks, forbidden


def _reference(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """Bit t % 32 of word t // 32, one token at a time."""
    out = np.ones((bitmask.shape[0], vocab), dtype=bool)
    for r in range(bitmask.shape[0]):
        for t in range(min(vocab, bitmask.shape[1] * 32)):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            out[r, t] = not (word >> (t % 32)) & 1
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 100), st.integers(0, 2**31), st.booleans())
def test_forbidden_reads_each_bit(rows: int, vocab: int, seed: int, wider: bool) -> None:
    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32 - (1 if wider and vocab > 32 else 0)  # a model vocab past it
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    assert np.array_equal(forbidden(bitmask, vocab).numpy(), _reference(bitmask, vocab))


def test_apply_masks_touches_only_the_given_rows() -> None:
    x = torch.randn(4, 70)
    before = x.clone()
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 2] = 1 << 5  # token 69
    apply_masks(x, [1, 3], bitmask)
    assert torch.equal(x[[0, 2]], before[[0, 2]])
    assert torch.isfinite(x[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(x[3]).nonzero().flatten().tolist() == [69]
    assert x[1, 2] == before[1, 2]
    y = before.clone()
    apply_masks(y, [0, 1, 2, 3], np.repeat(bitmask[:1], 4, axis=0))  # all rows: one fill
    assert all(torch.isfinite(y[r]).nonzero().flatten().tolist() == [0, 2] for r in range(4))
