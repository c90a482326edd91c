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
"""

from __future__ import annotations

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

    @staticmethod
    def for_specs(specs: Sequence[KVSpec]) -> KVLayout:
        """From each layer's spec (``Model.kv_specs``): one group of every layer, unless
        global and sliding layers mix: then groups of as many layers as the rarer kind has
        (the last group of a kind may be shorter). The groups share the pool's per-slot
        tensors, so every layer's pages must have one format."""
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

    def block_bytes(self, block_size: int) -> int:
        """One block of the pool: a page of every slot's layer."""
        assert self.spec is not None, "a layout without a page format sizes no pool"
        return self.slots * self.spec.page_bytes(block_size)

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
            blocks = cdiv(num_tokens, block_size)
            if group.window is not None:
                blocks = min(blocks, cdiv(group.window - 1 + chunk, block_size) + 1)
            total += blocks
        return total
