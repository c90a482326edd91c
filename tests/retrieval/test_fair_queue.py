"""The ingestion queue's order: classes by priority, tenants in turn."""

from __future__ import annotations

import threading

from kvgate.retrieval.fair_queue import FairQueue


def _drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (item := q.get(0)) is not None:
        out.append(item)
    return out


def test_tenants_of_a_class_take_turns_a_newcomer_first() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.put("beta", "standard", f"b{i}")
    assert q.get(0) == "b0"  # running: beta's first job
    q.put("alpha", "standard", "a0")  # alpha's small file, behind beta's three
    q.put("gamma", "standard", "g0")
    q.put("alpha", "standard", "a1")
    # alpha waits for no more of beta's jobs: one job slice (b0) in all.
    assert _drain(q) == ["a0", "g0", "b1", "a1", "b2", "b3"]
    assert len(q) == 0


def test_a_higher_class_goes_first_whenever_it_waits() -> None:
    q: FairQueue[str] = FairQueue()
    q.put("bulk", "batch", "x0")
    q.put("beta", "standard", "b0")
    q.put("bulk", "batch", "x1")
    q.put("alpha", "critical", "a0")
    q.put("other", "unknown class", "o0")  # an unknown class waits with batch
    assert len(q) == 5
    assert _drain(q) == ["a0", "b0", "x0", "o0", "x1"]


def test_get_waits_for_a_put() -> None:
    q: FairQueue[str] = FairQueue()
    assert q.get(0) is None
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(q.get(60)))
    t.start()
    q.put("t", "standard", "job")
    t.join(60)
    assert got == ["job"]
