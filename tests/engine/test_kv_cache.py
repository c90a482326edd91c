"""KV cache manager accounting: blocks per tenant, peak blocks, fragmentation, prefix lookups."""

from __future__ import annotations

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
