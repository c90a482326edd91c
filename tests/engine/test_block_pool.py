from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.block_pool import BlockPool, hash_block_tokens


def test_allocate_and_release_round_trip() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3
    assert len({b.block_id for b in blocks}) == 5
    pool.release(blocks)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_over_allocation_is_refused_without_side_effects() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(AssertionError):
        pool.release([b])


def test_cached_free_block_is_reused_by_touch_and_evicted_lru() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    ha, hb = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.cache(a, ha)
    pool.cache(b, hb)
    pool.release([a, b, c])  # eviction order: a, then b, then c
    assert pool.lookup(ha) is a
    pool.touch([a])  # a hit takes a off the free queue
    assert pool.num_free_blocks == 2 and a.ref_count == 1
    (x,) = pool.allocate(1)  # least recently freed cached block is evicted first
    assert x is b and pool.lookup(hb) is None and pool.num_evictions == 1
    pool.check_invariants()


def test_hash_chain_depends_on_parent_and_salt() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], b"tenant-a") != h1
    assert hash_block_tokens(None, [1, 2, 3]) == h1
    # A salted root block can never pose as an unsalted block whose parent hash is the salt.
    assert hash_block_tokens(None, [4, 5], salt=h1) != hash_block_tokens(h1, [4, 5])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 4)),
        st.tuples(st.just("free"), st.integers(0, 100)),
        st.tuples(st.just("cache"), st.integers(0, 100), st.integers(0, 5)),
        st.tuples(st.just("hit"), st.integers(0, 5)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_pool_invariants_under_random_operations(program: list[tuple[object, ...]]) -> None:
    """Random alloc/free/cache/hit sequences never break the pool's bookkeeping."""
    pool = BlockPool(12)
    owners: list[list[object]] = []  # each owner holds one reference on each of its blocks
    for op in program:
        if op[0] == "alloc":
            n = int(op[1])  # type: ignore[call-overload]
            if n <= pool.num_free_blocks:
                owners.append(list(pool.allocate(n)))
        elif op[0] == "free" and owners:
            owner = owners.pop(int(op[1]) % len(owners))  # type: ignore[call-overload]
            pool.release(owner)  # type: ignore[arg-type]
        elif op[0] == "cache" and owners:
            owner = owners[int(op[1]) % len(owners)]  # type: ignore[call-overload]
            pool.cache(owner[0], hash_block_tokens(None, [int(op[2])]))  # type: ignore[arg-type, call-overload]
        elif op[0] == "hit":
            block = pool.lookup(hash_block_tokens(None, [int(op[1])]))  # type: ignore[call-overload]
            if block is not None:
                pool.touch([block])
                owners.append([block])
        pool.check_invariants()
        held: dict[int, int] = {}
        for owner in owners:
            for b in owner:
                held[b.block_id] = held.get(b.block_id, 0) + 1  # type: ignore[attr-defined]
        for block in pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
            if block.ref_count > 1:  # only cached prefixes are ever shared
                assert block.block_hash is not None
    for owner in owners:
        pool.release(owner)  # type: ignore[arg-type]
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()
