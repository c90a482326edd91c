"""Per-request KV block bookkeeping on top of the block pool: allocation, prefix hits, release,
and the return of blocks that fell out of a sliding window.

A request holds one block table per group of layers (``KVLayout``): token ``t`` of group
``g`` lives in ``tables[g][t // block_size]`` at slot ``t % block_size``. In a sliding-window
group, an entry is ``None`` once no later query can read it (it went back to the pool, still
cached for prefix hits if it was full); a global group keeps every block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvgate.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from kvgate.engine.offload import BlockRef, LoadCosts, LoadOrder, NullTier, OffloadingManager
from kvgate.engine.request import Request
from kvgate.model.kv_layout import KVGroup, KVLayout, cdiv

__all__ = ["KVCacheManager", "PrefixHit", "Table", "TierPlan", "cdiv"]

Table = list[KVBlock | None]
#: Prefix-cache hits of a request: one table per group, all of the same length (the hit in
#: blocks); sliding groups have ``None`` where the window no longer reaches.
PrefixHit = Sequence[Sequence[KVBlock | None]]


@dataclass(frozen=True)
class TierPlan:
    """A prefix longer than the pool's hit, found in the pool and the second tier together:
    per group, each entry a pool block (a hit), a key the tier holds (to load), or None
    (out of the window). ``num_tokens``: what it covers."""

    tables: tuple[tuple[KVBlock | BlockHash | None, ...], ...]
    num_tokens: int
    #: Some of the blocks to load are on their way for another request already: wait for
    #: them (they will be pool hits) rather than load a second copy.
    in_flight: bool = False

    @property
    def num_loads(self) -> int:
        return sum(1 for t in self.tables for e in t if isinstance(e, bytes))


def _one_group() -> KVLayout:
    return KVLayout((KVGroup((0,), None),), 1)


class KVCacheManager:
    """Maps requests to the blocks that hold their KV."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        layout: KVLayout | None = None,
        roles_apart: bool = False,
        tier: OffloadingManager | None = None,
    ):
        """``roles_apart``: the model computes prompt tokens differently from generated ones
        (``Model.prompt_tiles``), so a block holding generated tokens is keyed apart: a later
        prompt with the same tokens computes them as a prompt, never reads that block.
        ``tier``: a second KV tier (``offload.py``) that full blocks are stored to as they are
        cached and that a prefix missing from the pool is loaded from (None: none)."""
        self.block_size = block_size
        self.roles_apart = roles_apart
        self.layout = layout or _one_group()
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        #: Request id -> one block table per group.
        self.req_blocks: dict[str, list[Table]] = {}
        # Per request and group: how many leading entries are registered in the prefix cache,
        # and (sliding groups) how many leading entries were given back.
        self._num_cached: dict[str, list[int]] = {}
        self._num_dropped: dict[str, list[int]] = {}
        self._num_held: dict[str, int] = {}  # blocks (not None) over all of a request's tables
        # Metrics: prefix cache queries and hits, in tokens (vLLM's unit).
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: Blocks held by each tenant's requests (a block shared by two requests counts twice):
        #: what KV quotas are measured against.
        self.tenant_blocks: dict[str, int] = {}
        self.tenant_prefix_queries: dict[str, int] = {}
        self.tenant_prefix_hits: dict[str, int] = {}
        #: Blocks given back because they fell out of every window that reads them.
        self.num_window_freed = 0
        #: The second tier (``NullTier``: none), whether loading from it beats recomputing,
        #: blocks newly cached and not yet handed to it, loads not yet started, and the
        #: blocks of requests loading (those of a request that ended while its load ran
        #: stay held until the load is done: a thread is writing them).
        self.tier: OffloadingManager = tier or NullTier()
        self.tier_enabled = tier is not None and enable_prefix_caching
        self.load_costs = LoadCosts()
        self._stores: list[BlockRef] = []
        self._load_orders: list[LoadOrder] = []
        self._loads: dict[str, LoadOrder] = {}  # request id -> its load in flight
        self._orphans: dict[int, list[KVBlock]] = {}  # load id -> blocks of an ended request
        self._inflight: dict[BlockHash, int] = {}  # key -> loads in flight writing it
        self._next_load_id = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # ------------------------------------------------------------------ reading tables
    def block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's tables, one per group; -1 where a block was given back."""
        tables = self.req_blocks.get(request_id)
        if tables is None:
            return tuple(() for _ in self.layout.groups)
        return tuple(tuple(-1 if b is None else b.block_id for b in t) for t in tables)

    def held_blocks(self, request_id: str) -> list[KVBlock]:
        """Every block the request references, all groups."""
        return [b for t in self.req_blocks.get(request_id, ()) for b in t if b is not None]

    def num_held(self, request_id: str) -> int:
        return self._num_held.get(request_id, 0)

    def held_counts(self) -> dict[str, int]:
        """Blocks held by each request that holds any."""
        return dict(self._num_held)

    # ------------------------------------------------------------------ prefix cache
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            prompt_in_block = request.num_prompt_tokens - i * bs
            generated_from = None
            if self.roles_apart and prompt_in_block < bs:  # holds generated tokens
                generated_from = max(prompt_in_block, 0)
            hashes.append(hash_block_tokens(parent, tokens, request.cache_salt, generated_from))

    def _key(self, block_hash: BlockHash, group: int) -> BlockHash:
        """The block's cache key in ``group``: groups hold different layers' KV, so the same
        tokens are a different block in each (one group: the hash itself)."""
        if group == 0:
            return block_hash
        return hashlib.sha256(block_hash + group.to_bytes(2, "little")).digest()

    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """Longest cached prefix of a request that has no blocks yet: (tables, tokens covered).

        Every global group must hold every block of the prefix; a sliding group only those
        the next query still reads. At least one token is always left to compute, because the
        step that computes it is the one that produces the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._prefix_hashes(request)
        num = self._longest(hashes, lambda key: self.pool.lookup(key) is not None)
        if num <= 0:
            return [], 0
        hit = [
            [None if k is None else self.pool.lookup(k) for k in keys]
            for keys in self._needed_keys(hashes, num)
        ]
        return hit, num * self.block_size

    def tier_plan(self, request: Request, num_hit_tokens: int) -> TierPlan | None:
        """The longest prefix the pool and the tier hold together, where it is longer than
        the pool's hit of ``num_hit_tokens`` and loading beats recomputing (``LoadCosts``);
        else None."""
        if not self.tier_enabled:
            return None
        if not self.load_costs.decide(self.block_size / len(self.layout.groups)):
            return None
        hashes = self._prefix_hashes(request)
        tier = self.tier

        def held(key: BlockHash) -> bool:
            return self.pool.lookup(key) is not None or tier.contains(key)

        num = self._longest(hashes, held)
        if num * self.block_size <= num_hit_tokens:
            return None
        tables = tuple(
            tuple(None if k is None else (self.pool.lookup(k) or k) for k in keys)
            for keys in self._needed_keys(hashes, num)
        )
        waits = any(isinstance(e, bytes) and e in self._inflight for t in tables for e in t)
        return TierPlan(tables, num * self.block_size, waits)

    def _prefix_hashes(self, request: Request) -> list[BlockHash]:
        """The keys of the full blocks a prefix hit may cover (all but the last token's)."""
        self.update_block_hashes(request)
        return request.block_hashes[: (request.num_tokens - 1) // self.block_size]

    def _longest(self, hashes: Sequence[BlockHash], held: Callable[[BlockHash], bool]) -> int:
        """Base blocks of the longest prefix of ``hashes`` whose every needed block (each
        global group's, each sliding group's last window) is ``held``; whole blocks of every
        group (``KVLayout.reuse_span``)."""
        groups = self.layout.groups
        unit = self.layout.reuse_span  # a hit is whole blocks of every group
        num = len(hashes) - len(hashes) % unit
        for g, group in enumerate(groups):
            if group.window is None:
                for i in range(num // group.span):
                    if not held(self._group_key(hashes, g, i)):
                        num = i * group.span - (i * group.span) % unit
                        break
        # Sliding groups: the longest prefix whose last window is held in each.
        while num > 0 and not all(
            self._window_held(hashes, g, group, num, held)
            for g, group in enumerate(groups)
            if group.window is not None
        ):
            num -= unit
        return max(num, 0)

    def _needed_keys(self, hashes: Sequence[BlockHash], num: int) -> list[list[BlockHash | None]]:
        """Per group, the keys of the blocks a prefix of ``num`` base blocks needs (None
        before a sliding group's window)."""
        out: list[list[BlockHash | None]] = []
        for g, group in enumerate(self.layout.groups):
            first = group.first_needed_block(num * self.block_size, self.block_size * group.span)
            keys: list[BlockHash | None] = [None] * first
            keys += [self._group_key(hashes, g, i) for i in range(first, num // group.span)]
            out.append(keys)
        return out

    def _group_key(self, hashes: Sequence[BlockHash], g: int, i: int) -> BlockHash:
        """Block ``i`` of group ``g``: keyed by the hash of its last base block (which covers
        every token before it)."""
        return self._key(hashes[(i + 1) * self.layout.groups[g].span - 1], g)

    def _window_held(
        self,
        hashes: Sequence[BlockHash],
        g: int,
        group: KVGroup,
        num: int,
        held: Callable[[BlockHash], bool],
    ) -> bool:
        gbs = self.block_size * group.span
        first = group.first_needed_block(num * self.block_size, gbs)
        return all(held(self._group_key(hashes, g, i)) for i in range(first, num // group.span))

    def record_prefix_lookup(self, tenant: str, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits for blocks)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
        q, h = self.tenant_prefix_queries, self.tenant_prefix_hits
        q[tenant] = q.get(tenant, 0) + num_tokens
        h[tenant] = h.get(tenant, 0) + num_hit_tokens

    # ------------------------------------------------------------------ metrics
    def fragmentation(self, requests: Iterable[Request]) -> float:
        """Reserved but unfilled KV slots over reserved slots, over ``requests`` (running)."""
        reserved = filled = 0
        for r in requests:
            tables = self.req_blocks.get(r.request_id, ())
            for group, table in zip(self.layout.groups, tables, strict=False):
                bs = self.block_size * group.span
                dropped = next((i for i, b in enumerate(table) if b is not None), len(table))
                held = (len(table) - dropped) * bs
                reserved += held
                filled += min(max(r.num_computed_tokens - dropped * bs, 0), held)
        return (reserved - filled) / reserved if reserved else 0.0

    def num_reserved_slots(self) -> int:
        """Token slots in blocks held by requests (for fragmentation metrics)."""
        return sum(self.num_held(rid) for rid in self.req_blocks) * self.block_size

    def held_bytes_per_token(self, requests: Iterable[Request], block_bytes: int) -> float:
        """KV bytes the blocks of ``requests`` hold, per token of their computed context:
        what a token really costs (with windows and compressed entries, less than a
        block's bytes over its tokens). 0 without computed tokens."""
        blocks = tokens = 0
        for r in requests:
            blocks += self.num_held(r.request_id)
            tokens += r.num_computed_tokens
        return blocks * block_bytes / tokens if tokens else 0.0

    # ------------------------------------------------------------------ allocation
    def _plan(
        self, request: Request, num_new_tokens: int, hit: PrefixHit
    ) -> tuple[int, list[tuple[int, int]]]:
        """(tokens computed once the hits count, per group (entries to skip, blocks to add))."""
        tables = self.req_blocks.get(request.request_id)
        groups = self.layout.groups
        hit_tokens = len(hit[0]) * self.block_size * groups[0].span if hit else 0
        num_computed = request.num_computed_tokens + hit_tokens
        plan = []
        for g, group in enumerate(groups):
            bs = self.block_size * group.span
            end = cdiv(num_computed + num_new_tokens, bs)
            have = (len(tables[g]) if tables else 0) + (len(hit[g]) if hit else 0)
            start = max(have, group.first_needed_block(num_computed, bs))
            plan.append((start - have, max(end - start, 0)))
        return num_computed, plan

    def num_blocks_to_add(
        self, request: Request, num_new_tokens: int, computed_blocks: PrefixHit = ()
    ) -> int:
        """Blocks ``request`` will hold in addition after ``allocate_slots`` with these
        arguments (prefix hits included): what its tenant's quota is checked against."""
        _, plan = self._plan(request, num_new_tokens, computed_blocks)
        hits = sum(1 for t in computed_blocks for b in t if b is not None)
        return hits + sum(n for _, n in plan)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: PrefixHit = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` are prefix-cache hits for a request being scheduled for the first
        time (its ``num_computed_tokens`` must already be 0). Returns False, changing nothing,
        when the pool cannot supply the blocks.
        """
        _, plan = self._plan(request, num_new_tokens, computed_blocks)
        num_new_blocks = sum(n for _, n in plan)
        # Hits on free cached blocks come out of the free pool too.
        hits = [b for t in computed_blocks for b in t if b is not None]
        num_hits_now_free = sum(1 for b in hits if b.ref_count == 0)
        if num_new_blocks + num_hits_now_free > self.pool.num_free_blocks:
            return False
        rid = request.request_id
        groups = self.layout.groups
        tables = self.req_blocks.setdefault(rid, [[] for _ in groups])
        if rid not in self._num_cached:
            self._num_cached[rid] = [0] * len(groups)
            self._num_dropped[rid] = [0] * len(groups)
        if computed_blocks:
            self.pool.touch(hits)
            for g, hit_table in enumerate(computed_blocks):
                tables[g].extend(hit_table)
                self._num_cached[rid][g] = len(tables[g])
                self._num_dropped[rid][g] = sum(1 for b in hit_table if b is None)
        for g, (skip, add) in enumerate(plan):
            tables[g].extend([None] * skip)
            if add:
                tables[g].extend(self.pool.allocate(add))
        added = len(hits) + num_new_blocks
        self._num_held[rid] = self._num_held.get(rid, 0) + added
        if added:
            request.peak_kv_blocks = max(request.peak_kv_blocks, self.num_held(rid))
            tb = self.tenant_blocks
            tb[request.tenant] = tb.get(request.tenant, 0) + added
        return True

    def commit(self, request: Request) -> None:
        """The step ran: register the request's blocks now full of computed KV in the prefix
        cache, then give back the blocks no later query of a sliding group reads. Only here,
        after the KV is written: a request preempted or failed before its step ran never
        leaves a cached block that holds no KV."""
        self._cache_full_blocks(request, request.num_computed_tokens)
        self._drop_out_of_window(request)

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Register blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        rid = request.request_id
        known = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        for g, table in enumerate(self.req_blocks[rid]):
            num_full = known // self.layout.groups[g].span
            start = self._num_cached[rid][g]
            for i in range(start, min(num_full, len(table))):
                block = table[i]
                if block is not None and block.block_hash is None:
                    key = self._group_key(request.block_hashes, g, i)
                    self.pool.cache(block, key)
                    if self.tier_enabled and block.block_hash is not None:
                        self._stores.append(BlockRef(key, block.block_id, g))
            self._num_cached[rid][g] = max(start, min(num_full, len(table)))

    def trim(self, request: Request) -> int:
        """Give back the blocks past the request's known tokens: those that held only the
        rejected part of a speculative draft (never cached: they hold no computed token).
        Returns how many went back."""
        rid = request.request_id
        tables = self.req_blocks.get(rid)
        if tables is None:
            return 0
        tail: list[KVBlock] = []
        for g, table in enumerate(tables):
            keep = cdiv(request.num_tokens, self.block_size * self.layout.groups[g].span)
            if len(table) > keep:
                tail += [b for b in reversed(table[keep:]) if b is not None]
                del table[keep:]
                self._num_cached[rid][g] = min(self._num_cached[rid][g], keep)
        if tail:
            self.pool.release(tail)
            self._num_held[rid] -= len(tail)
            self._uncount(request.tenant, len(tail))
        return len(tail)

    def _drop_out_of_window(self, request: Request) -> None:
        rid = request.request_id
        tables = self.req_blocks.get(rid)
        if tables is None:
            return
        dropped = 0
        for g, group in enumerate(self.layout.groups):
            if group.window is None:
                continue
            bs = self.block_size * group.span
            first = group.first_needed_block(request.num_computed_tokens, bs)
            table = tables[g]
            for i in range(self._num_dropped[rid][g], min(first, len(table))):
                block = table[i]
                if block is not None:
                    self.pool.release([block])  # oldest first: evicted first
                    table[i] = None
                    dropped += 1
            self._num_dropped[rid][g] = max(self._num_dropped[rid][g], min(first, len(table)))
        if dropped:
            self.num_window_freed += dropped
            self._num_held[rid] -= dropped
            self._uncount(request.tenant, dropped)

    def free(self, request: Request) -> None:
        """Return every block of a request to the pool (finish, abort or preemption).

        Tail blocks are released first so that they are evicted first: the head of a prefix
        is the part most likely to be shared again. A request whose load from the tier is
        running keeps its blocks held (uncounted to its tenant) until ``finish_load``.
        """
        rid = request.request_id
        tables = self.req_blocks.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._num_dropped.pop(rid, None)
        self._num_held.pop(rid, None)
        if not tables:
            return
        longest = max(len(t) for t in tables)
        tail_first = [t[i] for i in reversed(range(longest)) for t in tables if i < len(t)]
        blocks = [b for b in tail_first if b is not None]
        self._uncount(request.tenant, len(blocks))
        load = self._loads.pop(rid, None)
        if load is not None:
            self._orphans[load.load_id] = blocks
            return
        self.pool.release(blocks)

    # ------------------------------------------------------------------ the second tier
    def start_load(self, request: Request, plan: TierPlan) -> bool:
        """Give a request that holds no blocks the blocks of ``plan``: its pool hits, and
        fresh blocks for what the tier holds, to be loaded (``take_loads``). False,
        changing nothing, when the pool cannot supply them. The request computes nothing
        until ``finish_load``."""
        rid = request.request_id
        assert rid not in self.req_blocks, "a loading request holds no blocks yet"
        hits = [e for t in plan.tables for e in t if isinstance(e, KVBlock)]
        num_hits_now_free = sum(1 for b in hits if b.ref_count == 0)
        if plan.num_loads + num_hits_now_free > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)  # before allocating: a free hit must not be evicted for a load
        fresh = iter(self.pool.allocate(plan.num_loads))
        tables: list[Table] = []
        refs: list[BlockRef] = []
        for g, entries in enumerate(plan.tables):
            table: Table = []
            for e in entries:
                if isinstance(e, bytes):
                    block = next(fresh)
                    refs.append(BlockRef(e, block.block_id, g))
                    table.append(block)
                else:
                    table.append(e)
            tables.append(table)
        self.req_blocks[rid] = tables
        self._num_cached[rid] = [0] * len(tables)
        self._num_dropped[rid] = [sum(1 for b in t if b is None) for t in tables]
        added = len(hits) + plan.num_loads
        self._num_held[rid] = added
        request.peak_kv_blocks = max(request.peak_kv_blocks, added)
        self.tenant_blocks[request.tenant] = self.tenant_blocks.get(request.tenant, 0) + added
        self._next_load_id += 1
        order = LoadOrder(rid, tuple(refs), self._next_load_id)
        self._loads[rid] = order
        self._load_orders.append(order)
        for ref in refs:
            self._inflight[ref.key] = self._inflight.get(ref.key, 0) + 1
        return True

    def is_loading(self, request_id: str, load_id: int) -> bool:
        """Whether ``load_id`` is the load in flight of the live request ``request_id``."""
        order = self._loads.get(request_id)
        return order is not None and order.load_id == load_id

    def finish_load(self, request: Request | None, order: LoadOrder, ok: bool) -> None:
        """``order`` is done (``ok``: every block read and checked). Its blocks join the
        prefix cache (``ok``) and go back to the pool's free queue: the request, requeued,
        finds them there. A request that ended meanwhile (``request`` None: its blocks were
        orphaned) gives them back."""
        for ref in order.blocks:
            left = self._inflight.get(ref.key, 0) - 1
            if left > 0:
                self._inflight[ref.key] = left
            else:
                self._inflight.pop(ref.key, None)
        orphaned = self._orphans.pop(order.load_id, None)
        if orphaned is not None:
            self.pool.release(orphaned)
            return
        if request is None or not self.is_loading(request.request_id, order.load_id):
            return
        del self._loads[request.request_id]
        if ok:
            for ref in order.blocks:
                self.pool.cache(self.pool.blocks[ref.block_id], ref.key)
        self.free(request)

    @property
    def num_loading(self) -> int:
        """Loads not yet finished, of live requests and of ended ones."""
        return len(self._loads) + len(self._orphans)

    def take_loads(self) -> list[LoadOrder]:
        """Loads to start (the engine hands them to its ``TierIO``)."""
        out, self._load_orders = self._load_orders, []
        return out

    def take_stores(self) -> list[BlockRef]:
        """Blocks cached since the last call, for the tier: their KV must be copied before
        the next step (until then no block can be reused). Only blocks that still hold
        their key: a block uncached since (the prefix cache reset after an engine error)
        may hold another request's KV by now, and is never stored under the old key."""
        out, self._stores = self._stores, []
        blocks = self.pool.blocks
        return [ref for ref in out if blocks[ref.block_id].block_hash == ref.key]

    def drop_stores(self) -> None:
        """Forget blocks not yet handed to the tier (their KV may be half written)."""
        self._stores.clear()

    def _uncount(self, tenant: str, n: int) -> None:
        left = self.tenant_blocks.get(tenant, 0) - n
        if left > 0:
            self.tenant_blocks[tenant] = left
        else:
            self.tenant_blocks.pop(tenant, None)

    def check_windows(self, requests: Iterable[Request]) -> None:
        """Raise AssertionError if a block some layer's window still reads was given back, or
        a global group lost one (used by tests)."""
        for r in requests:
            tables = self.req_blocks.get(r.request_id)
            if tables is None:
                continue
            held = sum(1 for t in tables for b in t if b is not None)
            assert self._num_held.get(r.request_id, 0) == held, (r.request_id, held)
            for group, table in zip(self.layout.groups, tables, strict=True):
                bs = self.block_size * group.span
                first = group.first_needed_block(r.num_computed_tokens, bs)
                computed = min(cdiv(r.num_computed_tokens, bs), len(table))
                for i in range(first, computed):
                    assert table[i] is not None, (r.request_id, group, i)
