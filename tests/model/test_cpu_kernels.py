"""Native CPU kernels against the plain-PyTorch paths they replace."""

from __future__ import annotations

import pytest
import torch

from kvgate.model.attention import AttentionMetadata, TorchAttention
from kvgate.model.cpu_kernels import load_fused_ops_lib, load_paged_decode
from kvgate.model.ops import FusedCpuLayerOps, TorchLayerOps
from kvgate.model.rope import RotaryEmbedding

kernel = load_paged_decode()
fused_lib = load_fused_ops_lib()
needs_kernels = pytest.mark.skipif(
    kernel is None or fused_lib is None, reason="no C compiler: kernels unavailable"
)


def _decode_meta(lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randint(0, num_blocks, (len(lens) * max_blocks,), generator=g)
    lens_t = torch.tensor(lens)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_blocks=tables,
        decode_lens=lens_t,
        prefills=(),
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(9, 3, 16), (4, 4, 8), (8, 1, 32)])
def test_paged_decode_kernel_matches_torch(
    dtype: torch.dtype, heads: int, kv_heads: int, block_size: int
) -> None:
    d, num_blocks = 64, 64
    lens = [1, 5, block_size, block_size + 1, 97, 200]
    meta = _decode_meta(lens, block_size, num_blocks, seed=heads)
    torch.manual_seed(0)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, d).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, d).to(dtype)
    q = torch.randn(len(lens), heads, d).to(dtype)
    plain = TorchAttention(heads, kv_heads, d)
    fast = TorchAttention(heads, kv_heads, d, decode_kernel=kernel)
    ref = plain.attend(q, q, q, k_cache, v_cache, meta).float()
    got = fast.attend(q, q, q, k_cache, v_cache, meta).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def _ops() -> tuple[FusedCpuLayerOps, TorchLayerOps]:
    assert fused_lib is not None
    rope = RotaryEmbedding(64, 4096, 1e5, None, torch.bfloat16, torch.device("cpu"))
    heads = (9, 3, 64)
    plain = TorchLayerOps(rope, TorchAttention(*heads), heads)
    fused = FusedCpuLayerOps(fused_lib, rope, heads, plain)
    # Exercise the kernels at every size, not only where they are dispatched to.
    fused.MAX_ROWS_ROPE = 1 << 30
    return fused, plain


@needs_kernels
def test_fused_rope_and_kv_write_are_bit_exact() -> None:
    fused, plain = _ops()
    torch.manual_seed(1)
    t, n, bs = 41, 24, 16
    qkv = (torch.randn(t, 15 * 64) * 2).bfloat16()
    positions = torch.randint(0, 4096, (t,))
    slots = torch.randperm(n * bs)[:t]
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=0,
        decode_blocks=torch.empty(0, dtype=torch.long),
        decode_lens=torch.empty(0, dtype=torch.long),
        prefills=(),
    )
    caches = [torch.zeros(3, n, bs, 64, dtype=torch.bfloat16) for _ in range(4)]
    got = fused.rope_write_kv(qkv, positions, caches[0], caches[1], meta)
    ref = plain.rope_write_kv(qkv, positions, caches[2], caches[3], meta)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@needs_kernels
def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    """A library linked with -ffast-math turns on flush-to-zero for the thread that loads it;
    ours must leave the process's floating-point state alone."""
    import numpy as np

    tiny = np.array([1e-40], dtype=np.float32)  # subnormal in float32
    assert (tiny * np.float32(1.0))[0] != 0.0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0
