"""Which layers share a KV block table, and how far back each group's layers look.

Tensor-free: the engine sizes the pool from it, the KV cache manager keeps one block table
per group, the runner builds one attention description per group, the model reads each
layer's through it.

A model whose layers all attend to the whole context has one group of all its layers: a
block is a page of KV for every layer. A model that mixes sliding-window layers with global
ones (Gemma 3: five sliding to one global) gets groups of equal size ``slots``: each group is
either all-global or all-sliding, and a block is a page of ``slots`` layers' KV, handed to
one group at a time. Layer ``j`` of every group writes into the same per-slot tensors, so the
pool's memory moves freely between groups. A sliding group can then give back the blocks
that fell out of its window while the global group keeps every block: a long sequence holds
O(window) blocks in its sliding groups.

A model with compressed layers (DeepSeek-V4, ``KVSpec.compressed``) gets two groups of every
such layer, with pages of each layer's own format: a sliding group of the per-token stream
(one block: ``block_size`` tokens of every layer), and a global group of the compressed
entries whose blocks ``span`` several base blocks (one block: the entries of
``span x block_size`` tokens of every layer, so each layer's page is whole entries). Both
groups' pages are views into one pool of equal blocks (as many bytes as the larger group's
block), so memory still moves freely between them; a prefix is reused in whole blocks of
every group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.errors import UnsupportedModel
from kvgate.model.kv_spec import KVSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table; ``layers[j]`` uses slot ``j``'s cache tensors."""

    layers: tuple[int, ...]
    window: int | None  # tokens each query sees (its own included); None: all
    #: Base blocks (``block_size`` tokens) one block of this group stands for.
    span: int = 1
    #: The group holds its layers' compressed entries, not their per-token pages.
    entries: bool = False

    def first_needed_block(self, next_pos: int, block_size: int) -> int:
        """The first block a query at position ``next_pos`` (or later) still reads: blocks
        before it may go back to the pool."""
        if self.window is None:
            return 0
        return max(next_pos - self.window + 1, 0) // block_size


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    slots: int  # layers per block (the largest group)
    #: The page format of every layer (``kv_spec.py``): the pool is sized and allocated
    #: from it. None: not known (layouts built for the scheduler alone, in tests).
    spec: KVSpec | None = None
    #: Each layer's spec, where their pages differ (compressed layers); else empty.
    specs: tuple[KVSpec, ...] = ()

    def tokens_per_block(self, group: int, block_size: int) -> int:
        return block_size * self.groups[group].span

    @property
    def reuse_span(self) -> int:
        """A prefix is reused in multiples of this many base blocks (whole blocks of every
        group)."""
        return math.lcm(*(g.span for g in self.groups))

    @staticmethod
    def for_specs(specs: Sequence[KVSpec], block_size: int = 16) -> KVLayout:
        """From each layer's spec (``Model.kv_specs``): one group of every layer, unless
        global and sliding layers mix: then groups of as many layers as the rarer kind has
        (the last group of a kind may be shorter). The groups share the pool's per-slot
        tensors, so every layer's pages must have one format. Compressed layers: see the
        module docstring (``block_size``: the base block, which the entry blocks span)."""
        if any(spec.kind == "compressed" for spec in specs):
            return KVLayout._compressed(specs, block_size)
        formats = {spec.page_format for spec in specs}
        if len(formats) != 1:
            raise UnsupportedModel(
                f"layers with different KV page formats ({sorted(formats)}) are not supported: "
                "the pool keeps one format",
                path="<config>",
            )
        n = len(specs)
        windows = {spec.window for spec in specs if spec.window is not None}
        if len(windows) > 1:
            raise UnsupportedModel(
                f"sliding layers with different windows ({sorted(windows)}) are not supported",
                path="<config>",
            )
        spec = next((s for s in specs if s.window is None), specs[0])
        full = [i for i in range(n) if specs[i].window is None]
        sliding = [i for i in range(n) if specs[i].window is not None]
        window = windows.pop() if windows else None
        if not full or not sliding:
            return KVLayout((KVGroup(tuple(range(n)), window),), n, spec)
        size = min(len(full), len(sliding))
        groups = [KVGroup(tuple(full[i : i + size]), None) for i in range(0, len(full), size)]
        groups += [
            KVGroup(tuple(sliding[i : i + size]), window) for i in range(0, len(sliding), size)
        ]
        return KVLayout(tuple(groups), size, spec)

    @staticmethod
    def _compressed(specs: Sequence[KVSpec], block_size: int) -> KVLayout:
        if any(spec.kind != "compressed" for spec in specs):
            raise UnsupportedModel(
                "compressed KV layers mixed with other kinds are not supported", path="<config>"
            )
        window = max(spec.window or 0 for spec in specs)
        rated = tuple(i for i, spec in enumerate(specs) if spec.rate)
        groups = [KVGroup(tuple(range(len(specs))), window)]
        if rated:
            # The fewest base blocks whose tokens are whole entries of every layer, times as
            # many as keep the entry block within the token block's bytes (so neither
            # group's blocks are mostly empty), up to 1024 tokens (the prefix-reuse unit).
            rates = [specs[i].rate or 1 for i in rated]
            least = math.lcm(*(r // math.gcd(r, block_size) for r in rates))
            token_bytes = sum(block_size * spec.bytes_per_token() for spec in specs)
            entry_bytes = _entry_block_bytes(specs, rated, least * block_size)
            fits = max(token_bytes // max(entry_bytes, 1), 1)
            span = least * max(min(fits, 1024 // (least * block_size)), 1)
            groups.append(KVGroup(rated, None, span=span, entries=True))
        return KVLayout(tuple(groups), len(specs), specs[0], tuple(specs))

    def block_bytes(self, block_size: int) -> int:
        """One block of the pool: a page of every slot's layer (compressed layers: the larger
        of a token block and an entry block)."""
        assert self.spec is not None, "a layout without a page format sizes no pool"
        if self.specs:
            token = sum(block_size * spec.bytes_per_token() for spec in self.specs)
            entry = 0
            for group in self.groups:
                if group.entries:
                    entry = _entry_block_bytes(self.specs, group.layers, group.span * block_size)
            return max(token, entry)
        return self.slots * self.spec.page_bytes(block_size)

    def page_rows(self, group: int, layer: int, block_size: int) -> int:
        """Rows of ``layer``'s page in a block of ``group``: tokens, or entries."""
        g = self.groups[group]
        if not g.entries:
            return block_size
        return g.span * block_size // (self.specs[layer].rate or 1)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def layer_slots(self, num_layers: int) -> list[tuple[int, int]]:
        """Per layer: (its group, its slot)."""
        out = [(-1, -1)] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                out[layer] = (g, slot)
        return out

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most, prefilled in chunks of
        up to ``chunk`` tokens: every block in a global group; in a sliding group, its
        window and the chunk being computed."""
        total = 0
        for group in self.groups:
            blocks = cdiv(num_tokens, block_size * group.span)
            if group.window is not None:
                blocks = min(blocks, cdiv(group.window - 1 + chunk, block_size) + 1)
            total += blocks
        return total


def _entry_block_bytes(specs: Sequence[KVSpec], layers: Sequence[int], tokens: int) -> int:
    """The compressed entries of ``tokens`` tokens of ``layers``."""
    return sum(tokens // (specs[i].rate or 1) * specs[i].entry_bytes() for i in layers)
