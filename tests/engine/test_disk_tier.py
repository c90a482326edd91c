"""The disk tier's files and index: LRU under a size limit, pins, restarts, damaged files, and
the load-or-recompute rule."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kvgate.engine.disk_tier import DiskTier
from kvgate.engine.offload import LoadCosts

FMT = hashlib.sha256(b"format").digest()
PAYLOAD = 1000
FILE = 84 + PAYLOAD  # header + payload


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def _store(tier: DiskTier, *ids: int) -> list[int]:
    keys = tier.prepare_store([_key(i) for i in ids], PAYLOAD)
    for k in keys:
        assert tier.write(k, bytes([ids[0] % 256]) * PAYLOAD)
    tier.complete_store(keys, ok=True)
    return [i for i in ids if _key(i) in keys]


def test_store_then_read_back(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 10 * FILE)
    assert _store(tier, 1, 2, 3) == [1, 2, 3]
    assert tier.lookup([_key(1), _key(2), _key(4), _key(3)]) == 2
    got = tier.read(_key(2), PAYLOAD)
    assert got is not None and bytes(got) == bytes([1]) * PAYLOAD
    assert _store(tier, 2, 5) == [5]  # 2 is held already
    state = tier.state()
    assert state.num_blocks == 4 and state.used_bytes == 4 * FILE
    assert oct(os.stat(tier.dir).st_mode & 0o777) == oct(0o700)
    assert all(oct(p.stat().st_mode & 0o777) == oct(0o600) for p in tier.dir.iterdir())


def test_size_limit_evicts_least_recently_used_unpinned(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 3 * FILE)
    _store(tier, 1, 2, 3)
    tier.complete_load([_key(1)])  # used: 2 is now the least recently used
    assert tier.prepare_load([_key(2)])  # ... but pinned by a load in flight
    _store(tier, 4)
    assert not tier.contains(_key(3)) and tier.contains(_key(2))
    assert not tier.path(_key(3)).exists()
    tier.complete_load([_key(2)])
    _store(tier, 5)
    assert not tier.contains(_key(1))
    assert {k for k in (1, 2, 4, 5) if tier.contains(_key(k))} == {2, 4, 5}
    assert tier.state().used_bytes == 3 * FILE
    assert tier.state().counters.evicted_blocks == 2
    # Nothing fits when every block is pinned.
    assert tier.prepare_load([_key(2), _key(4), _key(5)])
    assert _store(tier, 6) == []


def test_a_restart_finds_the_blocks_of_its_own_format_only(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 10 * FILE)
    _store(tier, 1, 2)
    (tier.dir / "x.kvb.tmp").write_bytes(b"half a write")
    tier.close()
    again = DiskTier(tmp_path, FMT, 10 * FILE)
    assert again.dir == tier.dir
    assert again.lookup([_key(1), _key(2)]) == 2
    assert not (tier.dir / "x.kvb.tmp").exists()
    other = DiskTier(tmp_path, hashlib.sha256(b"another model").digest(), 10 * FILE)
    assert other.lookup([_key(1)]) == 0
    again.close()
    # A smaller limit at restart evicts down to it.
    small = DiskTier(tmp_path, FMT, FILE)
    assert small.state().num_blocks == 1


def test_two_engines_of_one_format_never_share_a_folder(tmp_path: Path) -> None:
    """Replicas on one host: each claims its own folder (a lock), so none evicts or
    overwrites another's files; a restart claims the first free one again."""
    a = DiskTier(tmp_path, FMT, 10 * FILE)
    b = DiskTier(tmp_path, FMT, 10 * FILE)
    assert a.dir != b.dir and b.dir.name == a.dir.name + ".1"
    _store(a, 1)
    assert b.lookup([_key(1)]) == 0
    a.close()
    c = DiskTier(tmp_path, FMT, 10 * FILE)
    assert c.dir == a.dir and c.lookup([_key(1)]) == 1


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[:50], "shorter than its header"),
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "CRC-32"),
        (lambda b: b"NOTATIER" + b[8:], "not a kvgate"),
        (lambda b: b[:8] + bytes(32) + b[40:], "another model"),
        (lambda b: b[:40] + _key(9) + b[72:], "another block"),
    ],
)
def test_a_damaged_file_is_skipped_and_removed(
    tmp_path: Path, damage: object, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(tmp_path, FMT, 10 * FILE)
    _store(tier, 1)
    path = tier.path(_key(1))
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with caplog.at_level("WARNING", logger="kvgate.engine"):
        assert tier.read(_key(1), PAYLOAD) is None
    assert why in caplog.text
    assert not path.exists() and not tier.contains(_key(1))
    assert tier.state().used_bytes == 0


def test_a_payload_of_another_size_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 10 * FILE)
    _store(tier, 1)
    assert tier.read(_key(1), PAYLOAD + 2) is None


def test_failed_store_gives_its_room_back(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 2 * FILE)
    keys = tier.prepare_store([_key(1), _key(2)], PAYLOAD)
    assert len(keys) == 2 and tier.state().used_bytes == 2 * FILE
    tier.complete_store(keys, ok=False)
    assert tier.state().used_bytes == 0 and tier.lookup([_key(1)]) == 0


def test_load_costs_choose_the_cheaper_path() -> None:
    costs = LoadCosts()
    assert costs.worth_loading(16)  # nothing measured: load, and measure
    costs.observe_prefill(512, 0.512)  # 1 ms a token: 16 ms a block
    assert costs.worth_loading(16)
    costs.observe_load(10, 0.05)  # 5 ms a block
    assert costs.worth_loading(16)
    for _ in range(20):
        costs.observe_load(10, 0.5)  # 50 ms a block: a slow disk
    assert not costs.worth_loading(16)
    # Declined, but every RETRY_EVERY-th plan loads anyway, to measure again.
    decisions = [costs.decide(16) for _ in range(2 * LoadCosts.RETRY_EVERY)]
    assert decisions.count(True) == 2 and decisions[LoadCosts.RETRY_EVERY - 1]
    for _ in range(20):
        costs.observe_prefill(100, 1.0)  # 10 ms a token: a large model
    assert costs.worth_loading(16) and costs.decide(16)
