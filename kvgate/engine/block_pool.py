"""The KV block pool: reference-counted blocks, a prefix-hash cache and LRU eviction.

Pure Python, no tensors: a block here is an index into the runner's KV tensors.

Invariants (checked by ``check_invariants`` and the property tests):
- ``ref_count >= 0`` for every block.
- A block is in the free queue if and only if its ``ref_count`` is 0.
- ``cached[h] is b`` implies ``b.block_hash == h``; a block with a hash that is not in
  ``cached`` does not exist (hash and map entry are set and cleared together).
- The free queue is in eviction order: its head is the least recently freed block.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    salt: bytes | None = None,
    generated_from: int | None = None,
) -> BlockHash:
    """Key of one full block: a hash chain over the parent block's key and this block's tokens.

    The chain makes a key name the whole prefix, not just the block. ``salt`` separates
    caches (a tenant's, say) so equal prefixes from different salts never share blocks.
    ``generated_from``: where in the block generated tokens begin, for a model that computes
    them differently from prompt tokens (None: all prompt tokens, or it does not matter).
    SHA-256 rather than Python's ``hash``: a crafted prompt must not collide on purpose.
    """
    h = hashlib.sha256()
    # Length-prefixed parts, so no (parent, salt, role) triple can pose as another: a root
    # block salted with S must never equal an unsalted block whose parent hash is S, nor a
    # client's salt pose as a role boundary.
    role = b"" if generated_from is None else generated_from.to_bytes(4, "little")
    for part in (parent or b"", salt or b"", role):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return (
            f"KVBlock({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"
        )


class BlockPool:
    """All KV blocks of the engine; hands them out, takes them back, remembers full prefixes."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (head = least recently freed).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # Counters for metrics: evictions of cached blocks to make room.
        self.num_evictions = 0
        self._num_free_cached = 0  # free blocks holding a hash, kept as they move

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, including cached ones that may be evicted."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix, whether or not a request references them."""
        return len(self.cached)

    def num_free_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_free_cached

    def usage(self) -> float:
        """Fraction of blocks referenced by a request (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks, evicting the least recently freed cached prefixes first."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out: list[KVBlock] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._num_free_cached -= 1
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it off the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
                self._num_free_cached -= block.block_hash is not None
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; pass them in the order they should be evicted."""
        for block in blocks:
            if block.ref_count <= 0:
                raise AssertionError(f"double free of {block!r}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                self._num_free_cached += block.block_hash is not None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block whose KV now holds a full, hashed block of tokens."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            # Another block already holds this prefix (two requests computed it at once);
            # keep the first, this one stays a private copy and is freed as usual.
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self._num_free_cached += block.ref_count == 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix held by free blocks; returns how many were dropped."""
        dropped = 0
        for block in list(self._free.values()):
            if block.block_hash is not None:
                self._uncache(block)
                dropped += 1
        self._num_free_cached -= dropped
        return dropped

    def _uncache(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        for h, block in self.cached.items():
            assert block.block_hash == h, block
        free_cached = sum(1 for b in self._free.values() if b.block_hash is not None)
        assert self._num_free_cached == free_cached, (self._num_free_cached, free_cached)
