"""Per-request KV block bookkeeping on top of the block pool: allocation, prefix hits, release."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvgate.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from kvgate.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to the blocks that hold their KV.

    A request's blocks cover its first ``num_computed_tokens`` (+ the tokens being computed)
    in order: token ``t`` lives in ``blocks[t // block_size]`` at slot ``t % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        # Metrics: prefix cache queries and hits, in tokens (vLLM's unit).
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: Blocks held by each tenant's requests (a block shared by two requests counts twice):
        #: what KV quotas are measured against.
        self.tenant_blocks: dict[str, int] = {}
        self.tenant_prefix_queries: dict[str, int] = {}
        self.tenant_prefix_hits: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash_block_tokens(parent, tokens, request.cache_salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that has no blocks yet: (blocks, tokens covered).

        At least one token is always left to compute, because the step that computes it is the
        one that produces the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, tenant: str, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits for blocks)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
        q, h = self.tenant_prefix_queries, self.tenant_prefix_hits
        q[tenant] = q.get(tenant, 0) + num_tokens
        h[tenant] = h.get(tenant, 0) + num_hit_tokens

    def fragmentation(self, requests: Iterable[Request]) -> float:
        """Reserved but unfilled KV slots over reserved slots, over ``requests`` (running)."""
        reserved = filled = 0
        for r in requests:
            slots = len(self.req_blocks.get(r.request_id, ())) * self.block_size
            reserved += slots
            filled += min(r.num_computed_tokens, slots)
        return (reserved - filled) / reserved if reserved else 0.0

    def num_blocks_to_add(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> int:
        """Blocks ``request`` will hold in addition after ``allocate_slots`` with these
        arguments (prefix hits included): what its tenant's quota is checked against."""
        held = len(self.req_blocks.get(request.request_id, ()))
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(cdiv(num_computed + num_new_tokens, self.block_size) - held, 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` are prefix-cache hits for a request being scheduled for the first
        time (its ``num_computed_tokens`` must already be 0). Returns False, changing nothing,
        when the pool cannot supply the blocks.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(computed_blocks)
        # Hits on free cached blocks come out of the free pool too.
        num_hits_now_free = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_new_blocks + num_hits_now_free > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        held_before = len(blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached[request.request_id] = len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        if len(blocks) != held_before:
            request.peak_kv_blocks = max(request.peak_kv_blocks, len(blocks))
            tb = self.tenant_blocks
            tb[request.tenant] = tb.get(request.tenant, 0) + len(blocks) - held_before
        return True

    def commit(self, request: Request) -> None:
        """The step ran: register the request's blocks now full of computed KV in the prefix
        cache. Only here, after the KV is written: a request preempted or failed before its
        step ran never leaves a cached block that holds no KV."""
        self._cache_full_blocks(request, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Register blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        rid = request.request_id
        num_full = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        start = self._num_cached.get(rid, 0)
        blocks = self.req_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_cached[rid] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Return every block of a request to the pool (finish, abort or preemption).

        Tail blocks are released first so that they are evicted first: the head of a prefix
        is the part most likely to be shared again.
        """
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))
            left = self.tenant_blocks.get(request.tenant, 0) - len(blocks)
            if left > 0:
                self.tenant_blocks[request.tenant] = left
            else:
                self.tenant_blocks.pop(request.tenant, None)

    def num_reserved_slots(self) -> int:
        """Token slots in blocks held by requests (for fragmentation metrics)."""
        return sum(len(b) for b in self.req_blocks.values()) * self.block_size
