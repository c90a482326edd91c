"""The KV pool's tensors: zeroed, writable, page-aligned, shared by the layers of one slot."""

from __future__ import annotations

import torch

from kvgate.engine.runner import allocate_kv_caches
from kvgate.model.kv_layout import KVGroup, KVLayout


def test_the_pool_is_zero_writable_and_page_aligned() -> None:
    # a global group of layers 0, 1 and a sliding one of 2, 3: two slots, each shared
    layout = KVLayout((KVGroup((0, 1), None), KVGroup((2, 3), 512)), 2)
    shape = (64, 16, 2, 64)  # blocks, block size, KV heads, head dim: 256 KiB each in bf16
    caches = allocate_kv_caches(layout, 4, (shape, shape), torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 4
    for k, v in caches:
        for t in (k, v):
            assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
            assert t.data_ptr() % 4096 == 0  # fresh pages: any vector load is aligned
            assert not t.any()
    k0, v0 = caches[0]
    k0[5, 3] = 1.5
    assert k0[5, 3].eq(1.5).all() and not v0.any()
    assert caches[2][0] is k0 and caches[1][0] is not k0  # layers 0 and 2 share slot 0


def test_a_latent_pool_keeps_no_v() -> None:
    """A latent spec's V is within K: its V tensors are empty, so the pool holds K alone."""
    layout = KVLayout((KVGroup((0, 1), None),), 2)
    k_shape, v_shape = (1, 64, 16, 40), (1, 64, 16, 0)
    caches = allocate_kv_caches(layout, 2, (k_shape, v_shape), torch.float32, torch.device("cpu"))
    for k, v in caches:
        assert k.shape == k_shape and v.shape == v_shape and v.numel() == 0
