"""KV cache manager accounting: blocks per tenant, peak blocks, fragmentation, prefix lookups."""

from __future__ import annotations

from kvgate.engine.block_pool import hash_block_tokens
from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.request import Request
from kvgate.sampling_params import SamplingParams


def test_fragmentation_tenant_blocks_and_peaks() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=False)
    a = Request("a", list(range(40)), SamplingParams(), tenant="t1")  # 40 tokens: 3 blocks
    b = Request("b", list(range(16)), SamplingParams(), tenant="t2")  # 16 tokens: 1 block
    assert kv.num_blocks_to_add(a, 40) == 3
    assert kv.allocate_slots(a, 40) and kv.allocate_slots(b, 16)
    a.num_computed_tokens, b.num_computed_tokens = 40, 16
    # Reserved 4 blocks = 64 slots, filled 56: (64 - 56) / 64.
    assert kv.fragmentation([a, b]) == 8 / 64
    assert kv.tenant_blocks == {"t1": 3, "t2": 1}
    assert (a.peak_kv_blocks, b.peak_kv_blocks) == (3, 1)
    kv.free(a)
    assert kv.tenant_blocks == {"t2": 1} and a.peak_kv_blocks == 3
    assert kv.fragmentation([b]) == 0.0 and kv.fragmentation([]) == 0.0


def test_prefix_lookups_are_counted_per_tenant() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    kv.record_prefix_lookup("t1", 40, 32)
    kv.record_prefix_lookup("t2", 10, 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (50, 32)
    assert kv.tenant_prefix_queries == {"t1": 40, "t2": 10}
    assert kv.tenant_prefix_hits == {"t1": 32, "t2": 0}


def _hashes(prompt: list[int], generated: list[int], roles_apart: bool) -> list[bytes]:
    kv = KVCacheManager(num_blocks=8, block_size=4, roles_apart=roles_apart)
    request = Request("r", prompt, SamplingParams())
    for token in generated:
        request.append_output_token(token)
    kv.update_block_hashes(request)
    return list(request.block_hashes)


def test_blocks_holding_generated_tokens_are_keyed_apart_where_roles_differ() -> None:
    """With ``roles_apart`` (a model whose prompt tokens take other linears than generated
    ones) a block holding any generated token never shares its key with the same tokens as
    a prompt, so a later prompt never reads K/V computed as generated tokens; blocks of
    prompt tokens alone keep their keys, and without ``roles_apart`` nothing changes."""
    tokens = list(range(12))
    as_prompt = _hashes(tokens, [], roles_apart=True)
    answered = _hashes(tokens[:6], tokens[6:], roles_apart=True)
    assert answered[0] == as_prompt[0]  # tokens 0-3: a prompt's in both
    assert answered[1] != as_prompt[1] and answered[2] != as_prompt[2]  # 4-5 prompt, 6-7 not
    assert _hashes(tokens[:6], tokens[6:], roles_apart=False) == _hashes(tokens, [], False)
    # where the prompt ends inside the block is part of the key: 5 prompt tokens differ from 6
    assert _hashes(tokens[:5], tokens[5:], roles_apart=True)[1] != answered[1]


def test_no_client_salt_spells_a_role_boundary() -> None:
    """The boundary is its own length-prefixed part of the key, so a request's salt cannot
    be chosen to make its prompt block's key that of another's block of generated tokens."""
    tokens = list(range(4))
    generated = hash_block_tokens(None, tokens, b"x", generated_from=2)
    assert hash_block_tokens(None, tokens, b"x") != generated
    assert hash_block_tokens(None, tokens, b"x" + (2).to_bytes(4, "little")) != generated
    assert hash_block_tokens(None, tokens, b"x", generated_from=3) != generated


class _DictTier:
    """A second tier of keys only (``offload.OffloadingManager``'s queries)."""

    kind = "dict"

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def contains(self, key: bytes) -> bool:
        return key in self.keys


def test_tier_plan_joins_pool_hits_and_tier_blocks_and_loads_hold_blocks() -> None:
    tier = _DictTier()
    kv = KVCacheManager(num_blocks=16, block_size=4, tier=tier)  # type: ignore[arg-type]
    first = Request("a", list(range(30)), SamplingParams(), tenant="t")
    assert kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.commit(first)
    stored = kv.take_stores()
    assert [ref.block_id for ref in stored] == [b.block_id for b in kv.req_blocks["a"][0][:7]]
    tier.keys.update(ref.key for ref in stored)
    kv.free(first)
    # The pool lost the tail: blocks 3.. are evicted (their keys only in the tier now).
    for block in kv.req_blocks.get("a", [[]])[0]:
        assert block is None
    pool = kv.pool
    for ref in stored[3:]:
        pool._uncache(pool.blocks[ref.block_id])
    pool._num_free_cached -= len(stored) - 3
    pool.check_invariants()
    again = Request("b", list(range(30)), SamplingParams(), tenant="t")
    _, tokens = kv.get_computed_blocks(again)
    assert tokens == 12
    plan = kv.tier_plan(again, tokens)
    assert plan is not None and plan.num_tokens == 28 and plan.num_loads == 4
    assert kv.start_load(again, plan)
    (order,) = kv.take_loads()
    # Another request of the same prefix waits for this load instead of loading a copy.
    twin = Request("twin", list(range(30)), SamplingParams(), tenant="t")
    twin_plan = kv.tier_plan(twin, kv.get_computed_blocks(twin)[1])
    assert twin_plan is not None and twin_plan.in_flight
    assert [r.key for r in order.blocks] == [r.key for r in stored[3:7]]
    assert kv.tenant_blocks == {"t": 7} and kv.num_loading == 1
    # Ended while loading: its blocks stay held (a thread writes them), its tenant uncharged.
    kv.free(again)
    assert kv.tenant_blocks == {} and pool.num_used_blocks == 7
    kv.finish_load(None, order, ok=True)
    assert pool.num_used_blocks == 0 and kv.num_loading == 0
    pool.check_invariants()
    # A load that completes registers its blocks: the next lookup hits them in the pool.
    third = Request("c", list(range(30)), SamplingParams(), tenant="t")
    plan = kv.tier_plan(third, kv.get_computed_blocks(third)[1])
    assert plan is not None and not plan.in_flight and kv.start_load(third, plan)
    (order,) = kv.take_loads()
    kv.finish_load(third, order, ok=True)
    assert kv.get_computed_blocks(Request("d", list(range(30)), SamplingParams()))[1] == 28
    assert pool.num_used_blocks == 0
    pool.check_invariants()
