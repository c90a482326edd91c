"""The usage ledger: settled records, reconciliation after a crash, queries."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvgate.governance.usage import Counts, UsageLedger


def _rows(path: Path) -> list[tuple[str, str, int, str]]:
    with sqlite3.connect(path) as con:
        return con.execute(
            "SELECT request_id, status, completion_tokens, COALESCE(finish_reason, '') "
            "FROM usage ORDER BY request_id"
        ).fetchall()


def test_a_settled_request_is_one_record_with_its_counts(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "u.db")
    row = ledger.admit("r1", "alpha", "m", "m@1", prompt_tokens=10)
    ledger.delivered(row, Counts(10, 1)).result(5)
    ledger.progress(row, Counts(10, 5))
    ledger.settle(row, Counts(10, 7, 4, 1.5), "stop").result(5)
    out = ledger.query()
    assert out["totals"] == {
        "prompt_tokens": 10, "completion_tokens": 7, "cached_tokens": 4,
        "kv_block_seconds": 1.5, "requests": 1,
    }  # fmt: skip
    (record,) = out["records"]
    assert (record["request_id"], record["tenant"], record["status"]) == ("r1", "alpha", "settled")
    assert record["finish_reason"] == "stop" and record["model_version"] == "m@1"
    ledger.close()


def test_a_request_that_never_delivered_leaves_no_record(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "u.db")
    row = ledger.admit("r1", "alpha", "m", "m@1", prompt_tokens=10)
    ledger.settle(row, Counts(10, 0), "error").result(5)
    whole = ledger.admit("r2", "alpha", "m", "m@1", prompt_tokens=3)
    ledger.settle(whole, Counts(3, 2), "length", delivered=True).result(5)
    assert [r["request_id"] for r in ledger.query()["records"]] == ["r2"]
    ledger.close()


def test_reconcile_keeps_what_was_delivered_and_drops_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    ledger = UsageLedger(path, flush_s=0.05)
    delivered = ledger.admit("got-tokens", "a", "m", "m@1", prompt_tokens=5)
    ledger.delivered(delivered, Counts(5, 1)).result(5)
    ledger.progress(delivered, Counts(5, 9))
    ledger.admit("queued", "a", "m", "m@1", prompt_tokens=5)
    done = ledger.admit("done", "b", "m", "m@1", prompt_tokens=2)
    ledger.settle(done, Counts(2, 3), "stop", delivered=True).result(5)
    ledger.delivered(ledger.admit("flush", "a", "m", "m@1", 1), Counts(1, 1)).result(5)
    # A crash: the process is gone without settling (the writer is left as it is), and
    # the OS has let go of its lock.
    ledger._owner_lock.close()
    again = UsageLedger(path)
    assert (again.last_reconcile.reconciled, again.last_reconcile.dropped) == (2, 1)
    assert _rows(path) == [
        ("done", "settled", 3, "stop"),
        ("flush", "reconciled", 1, "interrupted"),
        ("got-tokens", "reconciled", 9, "interrupted"),  # its last counts
    ]
    assert UsageLedger(path).last_reconcile.reconciled == 0  # once only
    again.close()


def test_a_ledger_starting_leaves_a_live_ledgers_rows_alone(tmp_path: Path) -> None:
    """Replicas share one ledger file: one restarting must not settle (or drop) the
    requests another is still serving; a ledger that died has its rows reconciled."""
    path = tmp_path / "u.db"
    live = UsageLedger(path, flush_s=0.05)
    serving = live.admit("serving", "a", "m", "m@1", prompt_tokens=5)
    live.delivered(serving, Counts(5, 1)).result(5)
    live.delivered(live.admit("queued", "a", "m", "m@1", 5), Counts(0, 0)).result(5)
    dead = UsageLedger(path, flush_s=0.05)
    dead.delivered(dead.admit("orphan", "b", "m", "m@1", 5), Counts(5, 2)).result(5)
    dead._owner_lock.close()  # its process died
    restarted = UsageLedger(path)
    assert (restarted.last_reconcile.reconciled, restarted.last_reconcile.dropped) == (1, 0)
    live.settle(serving, Counts(5, 7), "stop", delivered=True).result(5)
    assert ("serving", "settled", 7, "stop") in _rows(path)
    assert ("orphan", "reconciled", 2, "interrupted") in _rows(path)
    for ledger in (live, restarted):
        ledger.close()


def test_query_filters_by_tenant_and_time(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "u.db")
    for rid, tenant in (("1", "a"), ("2", "b"), ("3", "a")):
        row = ledger.admit(rid, tenant, "m", "m@1", prompt_tokens=1)
        ledger.settle(row, Counts(1, 2), "stop", delivered=True).result(5)
    assert ledger.query(tenant="a")["totals"]["requests"] == 2
    records = ledger.query()["records"]
    assert ledger.query(since=records[1]["admitted_at"])["totals"]["requests"] == 2
    assert ledger.query(until=records[0]["admitted_at"])["totals"]["requests"] == 0
    ledger.close()


def test_a_flood_is_written_in_a_few_statements_not_one_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each statement hands the GIL over and waits for it back (up to 5 ms beside a busy
    thread): a batch must cost a few statements however many requests it holds."""
    writes: list[str] = []
    connect = UsageLedger._connect

    def traced(self: UsageLedger) -> sqlite3.Connection:
        con = connect(self)
        con.set_trace_callback(
            lambda sql: (
                writes.append(sql) if sql.split()[0] in ("INSERT", "UPDATE", "DELETE") else None
            )
        )
        return con

    monkeypatch.setattr(UsageLedger, "_connect", traced)
    ledger = UsageLedger(tmp_path / "u.db", flush_s=0.05)
    rows = [ledger.admit(f"r{i}", "flood", "m", "m@1", prompt_tokens=4) for i in range(300)]
    for i, row in enumerate(rows):
        if i % 3:  # two in three reached their client
            ledger.delivered(row, Counts(4, 1))
        ledger.progress(row, Counts(4, 2))
    last = None
    for i, row in enumerate(rows):
        last = ledger.settle(row, Counts(4, 5 + i % 7), "length")
    assert last is not None
    last.result(10)
    records = ledger.query()["records"]
    assert len(records) == 200 and {r["status"] for r in records} == {"settled"}
    assert sorted(int(r["request_id"][1:]) % 3 for r in records)[0] == 1  # undelivered: gone
    assert ledger.query()["totals"]["completion_tokens"] == sum(
        5 + i % 7 for i in range(300) if i % 3
    )
    assert len(writes) < 40, len(writes)  # 300 requests, 4 writes each: 1,200 one by one
    ledger.close()


def test_a_late_delivered_mark_does_not_set_the_counts_back(tmp_path: Path) -> None:
    """A stream's checkpoint (a delivered mark) can reach the database a batch after a
    later progress write: the record keeps the larger counts, which a crash then keeps."""
    path = tmp_path / "u.db"
    ledger = UsageLedger(path, flush_s=0.05)
    row = ledger.admit("r1", "a", "m", "m@1", prompt_tokens=5)
    ledger.delivered(row, Counts(5, 40)).result(5)
    ledger.delivered(row, Counts(5, 33)).result(5)  # queued before the 40, written after
    ledger._owner_lock.close()  # a crash
    again = UsageLedger(path)
    assert _rows(path) == [("r1", "reconciled", 40, "interrupted")]
    again.close()


def test_a_waiter_that_left_does_not_stop_the_writer(tmp_path: Path) -> None:
    """A stream whose client leaves while it waits for its delivered mark cancels the
    mark's future (``asyncio.wrap_future``); the writer must go on (it used to raise
    InvalidStateError in its thread and end there, so no write completed again)."""
    ledger = UsageLedger(tmp_path / "u.db", flush_s=0.5)
    row = ledger.admit("r1", "alpha", "m", "m@1", prompt_tokens=10)
    left = ledger.delivered(row, Counts(10, 1))
    assert left.cancel()  # still queued: the writer waits flush_s for more
    other = ledger.admit("r2", "alpha", "m", "m@1", prompt_tokens=3)
    ledger.settle(other, Counts(3, 2), "stop", delivered=True).result(10)
    ledger.settle(row, Counts(10, 4), "stop").result(10)
    assert [r[:3] for r in _rows(tmp_path / "u.db")] == [
        ("r1", "settled", 4), ("r2", "settled", 2),
    ]  # fmt: skip
    ledger.close()
