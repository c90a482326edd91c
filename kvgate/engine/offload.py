"""The second KV tier's contract: where full prefix blocks go when the pool lets them go, and
where a prefix that missed the pool is looked for before it is recomputed.

The shape is vLLM's ``OffloadingManager`` (lookup, prepare_load, complete_load,
prepare_store, complete_store), keyed by the pool's block keys (``block_pool.BlockHash``):
a key is a hash chain over the whole prefix, the tenant's salt and the KV group, so a tier
can never hand one tenant's blocks to another, and never a block whose prefix differs.

Metadata only: which keys the tier holds, pins against eviction while a load reads them,
and the LRU. Moving bytes is ``kv_transfer.TierIO``'s; storing them is the tier's own
(``disk_tier.DiskTier``). ``NullTier`` holds nothing and is the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.engine.block_pool import BlockHash


@dataclass(frozen=True)
class BlockRef:
    """Block ``block_id`` of the pool, holding group ``group``'s KV of the prefix ``key``."""

    key: BlockHash
    block_id: int
    group: int


@dataclass(frozen=True)
class LoadOrder:
    request_id: str
    blocks: tuple[BlockRef, ...]
    #: Unique per load: a request id may come back (a new request after an aborted one)
    #: while the old one's load is still running.
    load_id: int = 0


@dataclass
class TierCounters:
    """What a tier did since it was opened (``kvgate:kv_tier_*``)."""

    #: Blocks loaded back into the pool, and the load operations (one per request).
    loaded_blocks: int = 0
    loads: int = 0
    #: Loads that failed (a file missing, truncated or corrupt): recomputed instead.
    failed_loads: int = 0
    stored_blocks: int = 0
    #: Stores given up: the writer was behind (``max_pending_bytes``) or the disk failed.
    dropped_stores: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    #: Sum and count of load latencies (submit to done), seconds.
    load_seconds: float = 0.0
    #: Files found corrupt or truncated and skipped (then removed).
    corrupt: int = 0
    evicted_blocks: int = 0


@dataclass(frozen=True)
class TierState:
    """A copy of a tier's figures, for the engine's snapshot."""

    kind: str
    used_bytes: int
    capacity_bytes: int
    num_blocks: int
    counters: TierCounters


class OffloadingManager(Protocol):
    """A KV tier's bookkeeping. Thread-safe: the engine thread asks, I/O threads complete."""

    kind: str

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys``, from the first, the tier holds."""
        ...

    def contains(self, key: BlockHash) -> bool: ...

    def prepare_load(self, keys: Sequence[BlockHash]) -> bool:
        """Pin ``keys`` (not evicted until ``complete_load``); False, pinning nothing, when
        one is gone."""
        ...

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        """Unpin ``keys`` and mark them recently used."""
        ...

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: int) -> list[BlockHash]:
        """Which of ``keys`` (each of ``nbytes``) to store: those not held or on their way,
        with room made by evicting the least recently used unpinned blocks; none when there
        is no room."""
        ...

    def complete_store(self, keys: Sequence[BlockHash], ok: bool) -> None: ...

    def state(self) -> TierState: ...

    def close(self) -> None: ...


class NullTier:
    """No second tier: every lookup misses, nothing is stored."""

    kind = "none"

    def __init__(self) -> None:
        self.counters = TierCounters()

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        return 0

    def contains(self, key: BlockHash) -> bool:
        return False

    def prepare_load(self, keys: Sequence[BlockHash]) -> bool:
        return not keys

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        pass

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: int) -> list[BlockHash]:
        return []

    def complete_store(self, keys: Sequence[BlockHash], ok: bool) -> None:
        pass

    def state(self) -> TierState:
        return TierState(self.kind, 0, 0, 0, TierCounters())

    def close(self) -> None:
        pass


class LoadCosts:
    """Whether loading a prefix from the tier beats recomputing it, from measured costs: the
    tier's seconds per block loaded and the engine's prefill seconds per token, each an
    exponential average. Until both are measured, load (the first load measures it).

    A load runs off the step (other requests go on meanwhile), a recompute takes the step's
    budget, so equal costs go to the load.
    """

    ALPHA = 0.3
    #: Once loading was judged slower, every this many plans one loads anyway, so a slow
    #: first measurement (a cold page cache, a disk hiccup) does not turn the tier off for
    #: good.
    RETRY_EVERY = 16

    def __init__(self) -> None:
        self.load_s_per_block: float | None = None
        self.prefill_s_per_token: float | None = None
        self._declined = 0

    def observe_load(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self.load_s_per_block = _ewma(self.load_s_per_block, seconds / num_blocks, self.ALPHA)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.prefill_s_per_token = _ewma(
                self.prefill_s_per_token, seconds / num_tokens, self.ALPHA
            )

    def worth_loading(self, tokens_per_block: float) -> bool:
        """Pure query: load rather than recompute, per block loaded holding the KV of
        ``tokens_per_block`` tokens' worth of prefill (a base block's tokens over the KV
        groups: recomputing a token fills every group at once)."""
        if self.load_s_per_block is None or self.prefill_s_per_token is None:
            return True
        return self.load_s_per_block <= self.prefill_s_per_token * tokens_per_block

    def decide(self, tokens_per_block: float) -> bool:
        """``worth_loading``, but yes once every ``RETRY_EVERY`` refusals (to measure again)."""
        if self.worth_loading(tokens_per_block):
            return True
        self._declined += 1
        if self._declined >= self.RETRY_EVERY:
            self._declined = 0
            return True
        return False


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
