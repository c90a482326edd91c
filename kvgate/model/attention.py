"""Paged attention behind a backend interface.

The runner describes a step as one flat batch (the layout GPU paged-attention kernels read):
every scheduled token in one row, with a slot mapping into the KV pool and a block table per
sequence. ``TorchAttention`` is the plain-PyTorch backend for the CPU; a GPU backend swaps in a
kernel behind the same ``forward``.

KV cache of one layer: ``k_cache``, ``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim].
Token ``t`` of a sequence lives at flat slot
``block_table[t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSlice:
    """A sequence with more than one query token this step (a prompt or a prompt chunk)."""

    token_start: int  # row of its first token in the flat batch
    token_end: int
    start_pos: int  # tokens of KV already in the cache before this step
    block_table: torch.Tensor  # [num_blocks_of_seq] int64

    @property
    def context_len(self) -> int:
        return self.start_pos + self.token_end - self.token_start


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step; built once, shared by all layers.

    Decode sequences (one query token each) come first in the flat batch, rows
    ``[0, num_decodes)``; prefill slices follow.
    """

    slot_mapping: torch.Tensor  # [T] int64, flat slot of each token's K/V
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: tuple[PrefillSlice, ...]


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


class TorchAttention:
    """Paged attention in plain PyTorch: batched decode, per-sequence prefill."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # Write this step's K/V first, so every sequence reads its whole context from the pool.
        hkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache, meta)
        for p in meta.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, k, v, k_cache, v_cache, p)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        b, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        # Gather each sequence's blocks: [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D].
        keys = k_cache[meta.decode_block_tables].view(b, -1, hkv, d).transpose(1, 2)
        values = v_cache[meta.decode_block_tables].view(b, -1, hkv, d).transpose(1, 2)
        # GQA without repeating K/V: the query heads sharing a KV head act as that head's
        # "query rows": q [B, Hq, D] -> [B, Hkv, group, D]. One query token means no causal mask,
        # only the padding mask for blocks past each sequence's length.
        qg = q.view(b, hkv, self.group, d)
        o = F.scaled_dot_product_attention(
            qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale
        )
        return o.reshape(b, self.num_heads, d)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        p: PrefillSlice,
    ) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        qs = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if p.start_pos == 0:
            # A whole fresh prompt: its keys are exactly this step's, no gather needed.
            ks = k[p.token_start : p.token_end]
            vs = v[p.token_start : p.token_end]
            mask = None
            causal = True
        else:
            ks = k_cache[p.block_table].view(-1, hkv, d)[: p.context_len]
            vs = v_cache[p.block_table].view(-1, hkv, d)[: p.context_len]
            lq = p.token_end - p.token_start
            # Query i sits at position start_pos + i and sees keys 0 .. start_pos + i.
            q_pos = torch.arange(p.start_pos, p.start_pos + lq, device=q.device)
            mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)  # [Lq, Hq, D]
