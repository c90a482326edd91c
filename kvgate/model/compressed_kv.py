"""The paged pool's compressed KV (``KVSpec.compressed``, DeepSeek-V4): each layer keeps a
window of per-token vectors and, where it compresses, one entry per ``rate`` tokens for the
whole sequence, each stream in blocks of its own group (``kv_layout.py``).

This backend owns where a token's vector or an entry lives and reads and writes them; what
the vectors hold and how they are attended is the model's (``deepseek_v4.py``). Token ``t``
of a sequence is row ``t % block_size`` of block ``token_table[t // block_size]``; entry
``e`` of a layer of rate ``r`` is row ``e % (span * block_size / r)`` of block
``entry_table[e * r // (span * block_size)]``. Pages are views into one pool of equal
blocks (``compressed_views``), so they are strided along the block axis; they are
read and written by (block, row) indices, never flattened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgate.model.attention import ScheduledRows
from kvgate.model.kv_layout import KVGroup, KVLayout


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's share of a step: flat-batch rows ``[row_start, row_end)`` hold its
    tokens at positions ``start_pos`` .. ``context_len - 1``."""

    row_start: int
    row_end: int
    start_pos: int
    context_len: int
    token_table: torch.Tensor  # [blocks] int64, -1 where out of the window
    entry_table: torch.Tensor  # [entry blocks] int64 (empty without entries)


@dataclass(frozen=True)
class CompressedMetadata:
    """The step as a compressed layer reads it (the same for every layer)."""

    sequences: tuple[SequenceRows, ...]
    block_size: int
    entry_span: int  # tokens one entry block covers: span x block_size


class CompressedKV:
    """The ``torch-compressed`` backend: addressing of the two streams, in PyTorch."""

    def __init__(self, layout: KVLayout | None, kv_dtype: torch.dtype) -> None:
        self.kv_dtype = kv_dtype
        self.layout = layout
        #: No native attention kernel reads these pages.
        self.decode_kernel = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError("compressed pages are views of one pool (compressed_views)")

    v_cache_shape = kv_cache_shape

    def kv_block_bytes(self, block_size: int) -> int:
        assert self.layout is not None
        return self.layout.block_bytes(block_size)

    def native_layout(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        return None

    def build_metadata(
        self,
        g: int,
        group: KVGroup,
        decodes: Sequence[ScheduledRows],
        prefills: Sequence[ScheduledRows],
        block_size: int,
        device: torch.device,
    ) -> CompressedMetadata:
        """Every group's tables at once: a compressed layer reads both its streams."""
        assert self.layout is not None
        groups = self.layout.groups
        span = groups[1].span if len(groups) > 1 else 1
        rows, out = 0, []
        for seq in (*decodes, *prefills):
            tables = seq.tables
            out.append(
                SequenceRows(
                    rows,
                    rows + seq.num_tokens,
                    seq.start_pos,
                    seq.context_len,
                    torch.tensor(tables[0], dtype=torch.int64, device=device),
                    torch.tensor(
                        tables[1] if len(tables) > 1 else (), dtype=torch.int64, device=device
                    ),
                )
            )
            rows += seq.num_tokens
        return CompressedMetadata(tuple(out), block_size, span * block_size)


def token_rows(
    pages: torch.Tensor,  # [num_blocks, block_size, dim]
    seq: SequenceRows,
    start: int,
    end: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, rows) of positions ``start .. end - 1`` of ``seq`` in the token pages."""
    pos = torch.arange(start, end, device=pages.device)
    blocks = seq.token_table[pos // block_size]
    return blocks, pos % block_size


def write_tokens(
    pages: torch.Tensor, seq: SequenceRows, values: torch.Tensor, block_size: int
) -> None:
    """The step's vectors of ``seq`` [n, dim], at its positions."""
    blocks, rows = token_rows(pages, seq, seq.start_pos, seq.context_len, block_size)
    pages[blocks, rows] = values.to(pages.dtype)


def read_tokens(
    pages: torch.Tensor, seq: SequenceRows, start: int, end: int, block_size: int
) -> torch.Tensor:
    """Positions ``start .. end - 1`` of ``seq`` [n, dim] (all within its window)."""
    blocks, rows = token_rows(pages, seq, start, end, block_size)
    assert bool((blocks >= 0).all()), "a position read out of the window"
    return pages[blocks, rows]


def _entry_rows(
    pages: torch.Tensor, seq: SequenceRows, first: int, end: int, rate: int, entry_span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    per_block = entry_span // rate
    entry = torch.arange(first, end, device=pages.device)
    return seq.entry_table[entry // per_block], entry % per_block


def write_entries(
    pages: torch.Tensor,  # [num_blocks, entries per block, dim]
    seq: SequenceRows,
    first: int,
    values: torch.Tensor,  # [n, dim]: entries first .. first + n - 1
    rate: int,
    entry_span: int,
) -> None:
    blocks, rows = _entry_rows(pages, seq, first, first + values.shape[0], rate, entry_span)
    pages[blocks, rows] = values.to(pages.dtype)


def read_entries(
    pages: torch.Tensor, seq: SequenceRows, end: int, rate: int, entry_span: int
) -> torch.Tensor:
    """Entries ``0 .. end - 1`` of ``seq`` [end, dim]."""
    blocks, rows = _entry_rows(pages, seq, 0, end, rate, entry_span)
    return pages[blocks, rows]


def compressed_views(
    layout: KVLayout, pool: torch.Tensor, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (its token pages [num_blocks, block_size, k_dim], its entry pages
    [num_blocks, entries a block, v_dim], or an empty tensor), all views of ``pool``
    [num_blocks, block bytes / item]: a block is a page of every layer of whichever group
    holds it."""
    num_blocks = pool.shape[0]
    entry_group = next((g for g, group in enumerate(layout.groups) if group.entries), None)
    out = []
    token_at = entry_at = 0
    for i, spec in enumerate(layout.specs):
        n = block_size * spec.k_dim
        k = pool[:, token_at : token_at + n].view(num_blocks, block_size, spec.k_dim)
        token_at += n
        v = pool.new_empty((0,))
        if spec.rate and entry_group is not None:
            rows = layout.page_rows(entry_group, i, block_size)
            v = pool[:, entry_at : entry_at + rows * spec.v_dim].view(num_blocks, rows, spec.v_dim)
            entry_at += rows * spec.v_dim
        out.append((k, v))
    return out
