"""Paged attention behind a backend interface.

The runner describes a step as one flat batch (the layout GPU paged-attention kernels read):
every scheduled token in one row, with a slot mapping into the KV pool and a block table per
sequence. ``TorchAttention`` is the plain-PyTorch backend for the CPU; a GPU backend swaps in a
kernel (and its own cache layout) behind the same interface.

Token ``t`` of a sequence lives at flat slot
``block_table[t // block_size] * block_size + t % block_size``.

The KV cache's dtype and layout belong to the backend alone: the engine sizes and allocates
the pool from ``kv_dtype``, ``kv_cache_shape`` and ``kv_block_bytes``; everything else that
writes or reads the caches goes through ``write_kv`` or asks ``native_layout`` whether native
code may touch them in place (the fused RoPE + KV write, the whole-layer decode), and falls
back to ``write_kv`` when the answer is no.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from kvgate.model.kv_codec import KVCodec
from kvgate.model.kv_layout import KVGroup
from kvgate.model.kv_spec import scale_groups

if TYPE_CHECKING:
    from kvgate.model.cpu_kernels import PagedDecodeKernel


#: A prefill slice runs on AMX tiles where the CPU has them (``TorchAttention._tiled_prefill``)
#: while its context times the head size is at most this; longer ones on SDPA (flash
#: attention, whose blocks keep the scores in cache at any length, where the tiles take a
#: whole row of 16 queries' scores through it). Measured: a 512-token chunk after 7.7k
#: cached tokens 1.6-1.7x SDPA's speed with SmolLM2's heads (9 / 3 x 64), 0.8-0.9x with
#: Qwen2.5-1.5B's (12 / 2 x 128), 1.2-2.3x at 2.5k tokens (bench/prefill_attention.py).
_TILED_PREFILL_MAX = 8192 * 64
#: The same limit where the native prefill runs with vdpbf16ps on AVX-512 registers (no AMX
#: tiles): against PyTorch's bf16 matmuls and SDPA without AMX it wins at every length
#: measured, up to a 512-token chunk after 31k cached tokens (AMD EPYC Zen 4: 2.4x with
#: SmolLM2's heads, 1.4x with Qwen2.5-1.5B's; 2.4-3.4x at 1k and below); past what was measured
#: SDPA keeps it.
_REGISTERS_PREFILL_MAX = 32768 * 128
#: Fresh prompts up to this many tokens use ``_short_prefill`` (measured crossover ~300).
_SHORT_PREFILL = 256
#: A fresh prompt up to this many tokens longer runs its first ``_SHORT_PREFILL`` on that
#: path and the rest as a chunk; longer ones go to SDPA whole. The split is what chunked
#: prefill computes anyway, and faster in one step (SmolLM2 bf16 prefill steps: 260 tokens
#: 92 vs 111 ms whole in SDPA, 384 tokens 147 vs 178, 512 tokens 221 vs 265).
_SHORT_TAIL = 256


@dataclass(frozen=True)
class PrefillSlice:
    """A sequence with more than one query token this step (a prompt or a prompt chunk)."""

    token_start: int  # row of its first token in the flat batch
    token_end: int
    start_pos: int  # tokens of KV already in the cache before this step
    block_table: torch.Tensor  # [num_blocks read] int64, from the first its window reaches
    kv_start: int = 0  # position of the first token of ``block_table``'s first block

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
    decode_blocks: torch.Tensor  # [num_decodes * max_blocks] int64, block tables, 0-padded
    decode_lens: torch.Tensor  # [num_decodes] int64, context length of each decode
    prefills: tuple[PrefillSlice, ...]
    #: [num_decodes] int64: position of the first token of each decode's first block in
    #: ``decode_blocks`` (sliding-window layers read from the window's first block); None: 0.
    decode_kv_start: torch.Tensor | None = None

    @cached_property
    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every prefill slice as a native kernel reads them (``slice_tables``), built on
        first use, once a step (every layer shares the metadata)."""
        return slice_tables(self.prefills)


def slice_tables(slices: Sequence[PrefillSlice]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill slices as a native kernel reads them: [S, 4] int64 (token_start, token_end,
    start_pos, offset of the slice's first block id) and the slices' block ids end to end."""
    rows, at = [], 0
    for p in slices:
        rows.append((p.token_start, p.token_end, p.start_pos, at))
        at += int(p.block_table.numel())
    blocks = [p.block_table for p in slices]
    tables = torch.cat(blocks) if blocks else torch.empty((0,), dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64).view(-1, 4), tables


class ScheduledRows(Protocol):
    """One sequence's share of a step, as a metadata builder reads it (the engine's
    ``ScheduledSequence``): tokens at positions ``start_pos`` .. ``context_len - 1``, and
    its block table per KV group."""

    @property
    def start_pos(self) -> int: ...

    @property
    def context_len(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]: ...


def paged_metadata(
    g: int,
    group: KVGroup,
    decodes: Sequence[ScheduledRows],
    prefills: Sequence[ScheduledRows],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Group ``g``'s view of the step for paged K/V: where each token's K/V goes, and the
    blocks each sequence reads (from the first one its window reaches)."""
    bs, dev = block_size, device
    slots: list[int] = []
    for seq in (*decodes, *prefills):
        table = seq.tables[g]
        for pos in range(seq.start_pos, seq.context_len):
            block = table[pos // bs]
            assert block >= 0, (seq, g, pos)  # written blocks are held
            slots.append(block * bs + pos % bs)
    # One decode row per position: a draft's row j attends to the context up to and
    # including its own token, as the decode of that position would.
    rows = [(s.tables[g], pos) for s in decodes for pos in range(s.start_pos, s.context_len)]
    num_dec = len(rows)
    starts = [group.first_needed_block(pos, bs) for _, pos in rows]
    if num_dec:
        ends = [-(-(pos + 1) // bs) for _, pos in rows]
        max_blocks = max(e - f for e, f in zip(ends, starts, strict=True))
        flat_tables: list[int] = []
        for (table, _), first, end in zip(rows, starts, ends, strict=True):
            part = table[first:end]
            # Padding past decode_lens: never read.
            flat_tables += part + (0,) * (max_blocks - len(part))
        decode_blocks = torch.tensor(flat_tables, dtype=torch.int64, device=dev)
        lens = torch.tensor([pos + 1 for _, pos in rows], dtype=torch.int64, device=dev)
    else:
        decode_blocks = torch.empty((0,), dtype=torch.int64, device=dev)
        lens = torch.empty((0,), dtype=torch.int64, device=dev)
    slices: list[PrefillSlice] = []
    row = num_dec
    for seq in prefills:
        first = group.first_needed_block(seq.start_pos, bs)
        table = seq.tables[g][first : -(-seq.context_len // bs)]
        seq_table = torch.tensor(table, dtype=torch.int64, device=dev)
        slices.append(PrefillSlice(row, row + seq.num_tokens, seq.start_pos, seq_table, first * bs))
        row += seq.num_tokens
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        num_decodes=num_dec,
        decode_blocks=decode_blocks,
        decode_lens=lens,
        prefills=tuple(slices),
        decode_kv_start=torch.tensor([f * bs for f in starts], dtype=torch.int64, device=dev)
        if any(starts)
        else None,
    )


@dataclass(frozen=True)
class NativeKVLayout:
    """K/V caches as native kernels may write and read them in place: two contiguous tensors
    ``[num_kv_heads, num_blocks, block_size, head_dim]`` of ``dtype`` per layer (head-major),
    slot ``s`` at ``[:, s // block_size, s % block_size]``. Only a backend says whether its
    caches are laid out so (``AttentionBackend.native_layout``)."""

    num_kv_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    #: Rows quantized as ``kv_codec`` stores them ("int8", "fp8": ``head_dim`` bytes of
    #: values, then a float32 scale per ``kv_groups`` of them); None: rows of ``dtype``.
    codec: str | None = None
    kv_groups: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class AttentionBackend(Protocol):
    #: The element type of the KV cache this backend reads and writes.
    kv_dtype: torch.dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's K cache tensor."""
        ...

    def v_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's V cache tensor (empty where V is kept within K)."""
        ...

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one block of one layer's K and V together."""
        ...

    def native_layout(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> NativeKVLayout | None:
        """How native code may write and read these caches in place; None: only through
        ``write_kv`` and ``attend``."""
        ...

    def build_metadata(
        self,
        g: int,
        group: KVGroup,
        decodes: Sequence[ScheduledRows],
        prefills: Sequence[ScheduledRows],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """KV group ``g``'s view of a step whose decodes come first, then its prefills."""
        ...

    def write_kv(
        self,
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's K/V at ``meta.slot_mapping``."""
        ...

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], already written to the cache
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attention of every query over its sequence's context, read from the pool; with a
        ``window``, over the last ``window`` positions only (the query's own included)."""
        ...


def tiled_prefill_max(kernel: PagedDecodeKernel) -> int:
    """Context x head size up to which a prefill slice runs natively on this kernel's path."""
    return _TILED_PREFILL_MAX if kernel.prefill_tiles else _REGISTERS_PREFILL_MAX


class TorchAttention:
    """Paged attention in plain PyTorch: batched decode, per-sequence prefill.

    Cache layout is head-major, ``[Hkv, num_blocks, block_size, D]``: gathering a batch's
    blocks with one ``index_select`` then yields each head's keys contiguous,
    ``[Hkv, B, L, D]``, ready for a batched matmul with no further copy.

    ``decode_kernel``: the native attention kernels (``cpu_kernels``): paged decode reading
    K/V straight from the pool instead of gathering a copy first (~3x less memory traffic
    per decode), and the causal softmax of short prompts in bf16 (one pass instead of five
    PyTorch ops).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        decode_kernel: PagedDecodeKernel | None = None,
        upcast: bool = False,
        scale: float | None = None,
        kv_dtype: torch.dtype = torch.float32,
        v_dim: int | None = None,
        v_in_k: bool = False,
        codec: KVCodec | None = None,
    ) -> None:
        """``head_dim``: of q and K; ``v_dim``: of V and the output (None: ``head_dim``);
        ``v_in_k``: V is the first ``v_dim`` entries of K and has no cache of its own (a
        latent spec: one KV head whose vector every query head reads); ``codec``: K/V rows
        stored otherwise than computed (``kv_codec.py``: int8, fp8 or a cast; None: as
        computed, in ``kv_dtype``)."""
        self.v_dim = head_dim if v_dim is None else v_dim
        self.v_in_k = v_in_k
        if v_in_k or self.v_dim != head_dim:
            decode_kernel = None  # the native kernels read K and V of one size, both cached
        self.codec = codec
        if codec is not None:
            # int8 and fp8 rows: the native decode reads them in place
            # (``decode_quantized``); other paths decode rows after the gather (PyTorch).
            # A cast has no native path.
            if not codec.scaled:
                decode_kernel = None
            kv_dtype = codec.storage_dtype
        self.decode_kernel = decode_kernel
        self.kv_dtype = kv_dtype
        #: bf16 attention matmuls computed in float32 and rounded back, for CPUs where
        #: PyTorch has no fast bf16 matmul (no AVX512-BF16: oneDNN refuses bf16 there and the
        #: fallback is ~10x slower than float32, 3.9 of 4.4 s of a 768-token prefill).
        self.upcast = upcast
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale

    def _width(self, dim: int) -> int:
        """Stored elements of a row of ``dim`` values (a quantized row carries its scale)."""
        return dim if self.codec is None else self.codec.row_width(dim)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, block_size, self._width(self.head_dim))

    def v_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        v_dim = 0 if self.v_in_k else self._width(self.v_dim)
        return (self.num_kv_heads, num_blocks, block_size, v_dim)

    def kv_block_bytes(self, block_size: int) -> int:
        dims = self._width(self.head_dim) + (0 if self.v_in_k else self._width(self.v_dim))
        return self.num_kv_heads * block_size * dims * self.kv_dtype.itemsize

    def build_metadata(
        self,
        g: int,
        group: KVGroup,
        decodes: Sequence[ScheduledRows],
        prefills: Sequence[ScheduledRows],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        return paged_metadata(g, group, decodes, prefills, block_size, device)

    def native_layout(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> NativeKVLayout | None:
        codec = self.codec
        if (
            (codec is not None and not codec.scaled)
            or self.v_in_k
            or k_cache.dim() != 4
            or k_cache.shape != v_cache.shape
            or k_cache.dtype != v_cache.dtype
            or k_cache.device.type != "cpu"
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            return None
        hkv, num_blocks, block_size, d = k_cache.shape
        if codec is None:
            return NativeKVLayout(hkv, num_blocks, block_size, d, k_cache.dtype)
        if d != codec.row_width(self.head_dim):
            return None
        groups = scale_groups(self.head_dim)
        return NativeKVLayout(
            hkv, num_blocks, block_size, self.head_dim, k_cache.dtype, codec.name, groups
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        hkv = self.num_kv_heads
        if self.codec is not None:
            k, v = self.codec.encode(k), self.codec.encode(v)
        k_cache.view(hkv, -1, k.shape[-1]).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        if not self.v_in_k:
            v_cache.view(hkv, -1, v.shape[-1]).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, window)
        out, rest = self._tiled_prefill(q, k_cache, v_cache, meta, window)
        if out is None:
            out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(
                q[: meta.num_decodes], k_cache, v_cache, meta, window
            )
        # K/V of this step are in the pool already, so every sequence reads its whole context
        # from there (a fresh prompt uses k and v directly: as stored, where rows are
        # quantized, so that it attends over what its chunked twin would read).
        if self.codec is not None and rest:
            k = self._decoded(self.codec.encode(k), k.shape[-1])
            v = (
                k[..., : self.v_dim]
                if self.v_in_k
                else self._decoded(self.codec.encode(v), v.shape[-1])
            )
        for p in rest:
            if window is not None and p.context_len > window:
                out[p.token_start : p.token_end] = self._windowed_prefill(
                    q, k, v, k_cache, v_cache, p, window
                )
            else:  # the window holds the whole context: plain causal attention
                out[p.token_start : p.token_end] = self._prefill(q, k, v, k_cache, v_cache, p)
        return out

    def _tiled_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None,
    ) -> tuple[torch.Tensor | None, Sequence[PrefillSlice]]:
        """The step's prefill slices in one native call (``prefill_bf16.h``: AMX tiles, or
        vdpbf16ps on AVX-512 registers), K/V read from the pool where they are: no gather, no
        per-slice PyTorch calls, only the causal keys; int8 and fp8 rows decoded as the
        decode kernel decodes them. Returns the step's output with those slices' rows
        written (None: none was), and the slices left to the PyTorch paths: all of them
        without AVX512-BF16 or for a float32 model, else those reading from past position
        0, longer than the window, or whose context times the head size passes
        ``tiled_prefill_max``. Decode rows are the caller's. Each
        slice goes one way whatever else the step holds, so its rows do not depend on it."""
        kernel, codec = self.decode_kernel, self.codec
        layout = self.native_layout(k_cache, v_cache)  # contiguous [Hkv, N, BS, row], K and V
        if (
            kernel is None
            or not kernel.prefills
            or layout is None
            or q.dtype != torch.bfloat16
            or (codec is None and layout.dtype != torch.bfloat16)
            or (codec is not None and codec.compute_dtype != q.dtype)
            or self.head_dim % 32
            or self.head_dim > kernel.MAX_HEAD_DIM
        ):
            return None, meta.prefills
        tiled: list[PrefillSlice] = []
        rest: list[PrefillSlice] = []
        limit = tiled_prefill_max(kernel)
        for p in meta.prefills:
            fits = p.context_len * self.head_dim <= limit and (
                window is None or p.context_len <= window
            )
            (tiled if fits and not p.kv_start else rest).append(p)
        if not tiled:
            return None, rest
        slices, tables = meta.prefill_tables if not rest else slice_tables(tiled)
        longest = max(p.context_len for p in tiled)
        groups, fp8 = (
            (0, False) if codec is None else (scale_groups(self.head_dim), codec.name == "fp8")
        )
        out = kernel.prefill(q, k_cache, v_cache, slices, tables, self.scale, longest, groups, fp8)
        return (None, meta.prefills) if out is None else (out, rest)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, dim: int) -> torch.Tensor:
        """[Hkv, N, bs, D] cache, [n] block ids -> [Hkv, n * bs, dim], contiguous per head,
        in the compute dtype (stored rows decoded after the gather)."""
        hkv, num_blocks, bs, d = cache.shape
        rows = cache.view(hkv, num_blocks, bs * d).index_select(1, blocks).view(hkv, -1, d)
        return rows if self.codec is None else self._decoded(rows, dim)

    def _decoded(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """Stored rows [..., width] -> [..., dim] in the compute dtype: ``codec.decode``,
        natively for int8/fp8 rows under a bf16 model (the same values, e4m3 ~15x faster:
        ``decode_rows_q8_bf16``)."""
        codec = self.codec
        assert codec is not None
        if (
            self.decode_kernel is not None
            and codec.scaled
            and codec.compute_dtype == torch.bfloat16
        ):
            out = self.decode_kernel.decode_rows(rows, dim, scale_groups(dim), codec.name == "fp8")
            if out is not None:
                return out
        return codec.decode(rows, dim)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None and int(meta.decode_lens.max()) <= window:
            window = None  # every context fits its window
        kernel = self.decode_kernel
        if (
            window is None
            and kernel is not None
            and kernel.supports(q.dtype, self.group, self.head_dim, k_cache.shape[2])
        ):
            if self.codec is not None:
                return kernel.decode_quantized(
                    q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, self.scale,
                    scale_groups(self.head_dim), self.codec.name == "fp8",
                )  # fmt: skip
            return kernel(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, self.scale)
        b, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        keys = self._gather(k_cache, meta.decode_blocks, d).view(hkv, b, -1, d)  # [Hkv, B, L, D]
        if self.v_in_k:
            values = keys[..., : self.v_dim]
        else:
            values = self._gather(v_cache, meta.decode_blocks, self.v_dim)
            values = values.view(hkv, b, -1, self.v_dim)
        # Padding past each sequence's length: bias [1, B, 1, L], 0 to attend, -inf to hide.
        span = torch.arange(keys.shape[2], device=q.device)[None, :]
        if meta.decode_kv_start is not None:
            span = span + meta.decode_kv_start[:, None]  # [B, L]: each key's position
        hidden = span >= meta.decode_lens[:, None]
        if window is not None:  # the query sits at len - 1 and sees positions > len - 1 - window
            hidden |= span < (meta.decode_lens - window)[:, None]
        bias = torch.zeros(hidden.shape, dtype=torch.float32, device=q.device)
        bias = bias.masked_fill_(hidden, float("-inf")).view(1, b, 1, -1)
        # GQA without repeating K/V: the query heads sharing a KV head are that head's
        # "query rows", q [B, Hq, D] -> [Hkv, B, group, D]. One query token per sequence
        # needs no causal mask, only the bias that hides padding past each length.
        qh = q.view(b, hkv, self.group, d).transpose(0, 1)
        scores = self._mm(qh, keys.transpose(-1, -2)).float()  # [Hkv, B, group, L]
        scores.mul_(self.scale).add_(bias)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = self._mm(probs, values)  # [Hkv, B, group, Dv]
        return out.transpose(0, 1).reshape(b, self.num_heads, self.v_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        p: PrefillSlice,
    ) -> torch.Tensor:
        lq = p.token_end - p.token_start
        if p.start_pos == 0 and lq <= _SHORT_PREFILL:
            return self._short_prefill(
                q[p.token_start : p.token_end],
                k[p.token_start : p.token_end],
                v[p.token_start : p.token_end],
            )
        if p.start_pos == 0 and lq <= _SHORT_PREFILL + _SHORT_TAIL:
            return self._short_prefill_and_tail(q, k, v, p)
        qs = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        ks, vs = self._context(k, v, k_cache, v_cache, p)  # [Hkv, ctx, D]
        mask = None
        if p.start_pos:
            # Query i sits at position start_pos + i and sees keys 0 .. start_pos + i.
            q_pos = torch.arange(p.start_pos, p.start_pos + lq, device=q.device)
            mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
        o = self._sdpa(qs, ks.unsqueeze(0), vs.unsqueeze(0), mask, mask is None)
        return o.squeeze(0).transpose(0, 1)  # [Lq, Hq, D]

    def _context(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        p: PrefillSlice,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a prefill slice reads, [Hkv, n, D], from position
        ``p.kv_start``: a fresh prompt's are exactly this step's (no gather); a chunk's come
        from the pool."""
        if p.start_pos == 0:
            return k[p.token_start : p.token_end].transpose(0, 1), v[
                p.token_start : p.token_end
            ].transpose(0, 1)
        n = p.context_len - p.kv_start
        keys = self._gather(k_cache, p.block_table, self.head_dim)[:, :n]
        if self.v_in_k:
            return keys, keys[..., : self.v_dim]
        return keys, self._gather(v_cache, p.block_table, self.v_dim)[:, :n]

    def _windowed_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        p: PrefillSlice,
        window: int,
    ) -> torch.Tensor:
        """A prompt (chunk) whose context is longer than the window: query at position i sees
        keys i - window + 1 .. i. [Lq, Hq, D]"""
        lq = p.token_end - p.token_start
        qs = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        # Keys from the first block the window reaches: positions kv_start .. context_len.
        ks, vs = self._context(k, v, k_cache, v_cache, p)
        q_pos = torch.arange(p.start_pos, p.start_pos + lq, device=q.device)[:, None]
        k_pos = torch.arange(p.kv_start, p.context_len, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        o = self._sdpa(qs, ks.unsqueeze(0), vs.unsqueeze(0), mask, False)
        return o.squeeze(0).transpose(0, 1)

    def _short_prefill_and_tail(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillSlice
    ) -> torch.Tensor:
        """A fresh prompt a little over ``_SHORT_PREFILL``: its first ``_SHORT_PREFILL``
        queries on ``_short_prefill``, the rest as a chunk that sees them (SDPA with a mask):
        what two chunks of prefill compute, in one step. [Lq, Hq, D]"""
        lq, head = p.token_end - p.token_start, _SHORT_PREFILL
        ks, vs = k[p.token_start : p.token_end], v[p.token_start : p.token_end]
        out = q.new_empty(lq, self.num_heads, self.v_dim)
        out[:head] = self._short_prefill(
            q[p.token_start : p.token_start + head], ks[:head], vs[:head]
        )
        tail = q[p.token_start + head : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        # Query i of the tail sits at position head + i and sees keys 0 .. head + i.
        q_pos = torch.arange(head, lq, device=q.device)
        mask = torch.arange(lq, device=q.device)[None, :] <= q_pos[:, None]
        o = self._sdpa(
            tail, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), mask, False
        )
        out[head:] = o.squeeze(0).transpose(0, 1)
        return out

    def _mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b in a's dtype (in float32 first, when ``upcast``)."""
        if self.upcast and a.dtype == torch.bfloat16:
            return torch.matmul(a.float(), b.float()).to(a.dtype)
        return torch.matmul(a, b)

    def _sdpa(
        self,
        q: torch.Tensor,  # [1, Hq, Lq, D]
        k: torch.Tensor,  # [1, Hkv, L, D]
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        dtype = q.dtype
        if self.upcast and dtype == torch.bfloat16:
            q, k, v = q.float(), k.float(), v.float()
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
        )
        return o.to(dtype)

    def _short_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a short fresh prompt with two batched matmuls.

        q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]. For a few hundred tokens this is ~1.5x
        faster than the CPU SDPA kernel; the query heads of a KV head become extra rows.
        """
        n, hkv, g, d = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        qh = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # rows (g, i)
        scores = self._mm(qh, k.transpose(0, 1).transpose(1, 2))  # [Hkv, g * L, L]
        kernel = self.decode_kernel
        probs = kernel.causal_softmax(scores, self.scale) if kernel is not None else None
        if probs is None:
            scores = scores.float().view(hkv, g, n, n)
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
            scores.mul_(self.scale).masked_fill_(causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(hkv, g * n, n)
        out = self._mm(probs, v.transpose(0, 1))  # [Hkv, g * L, Dv]
        dv = self.v_dim
        return out.view(hkv, g, n, dv).permute(2, 0, 1, 3).reshape(n, self.num_heads, dv)
