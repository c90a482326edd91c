"""The ingestion process's OS priority, set in a child so the test process keeps its own."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from typing import Any

import pytest

from kvgate.retrieval.ingest import lower_priority


def _report(priority: str, out: multiprocessing.Queue[tuple[str, int, int, int]]) -> None:
    got = lower_priority(priority)
    seen: list[int] = []
    # A thread started afterwards (as PyTorch's are) inherits the policy.
    t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
    t.start()
    t.join()
    out.put((got, os.nice(0), os.sched_getscheduler(0), seen[0]))


def _in_child(priority: str) -> tuple[str, int, int, int]:
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[tuple[str, int, int, int]] = context.Queue()
    proc = context.Process(target=_report, args=(priority, out))
    proc.start()
    result = out.get(timeout=60)
    proc.join(10)
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize(
    ("priority", "nice", "policy"),
    [("batch", 19, "SCHED_IDLE"), ("standard", 10, "SCHED_OTHER"), ("critical", 0, "SCHED_OTHER")],
)
def test_ingestion_runs_at_its_class_priority_and_its_threads_inherit_it(
    priority: str, nice: int, policy: str
) -> None:
    """``batch`` runs under SCHED_IDLE (only on a core nothing else wants), the others keep
    the normal policy at their nice value; threads started afterwards, as PyTorch's are,
    inherit it."""
    base = os.nice(0)
    got, niced, got_policy, thread_policy = _in_child(priority)
    assert got_policy == thread_policy == getattr(os, policy)
    assert niced == max(base, nice)
    assert got == f"nice {niced}" + (", SCHED_IDLE" if policy == "SCHED_IDLE" else "")


def _wait_and_report(go: Any, out: multiprocessing.Queue[tuple[int, int]]) -> None:
    go.wait(60)
    out.put((os.nice(0), os.sched_getscheduler(0)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_the_server_lowers_a_child_it_started_from_outside() -> None:
    """What ``IngestProcess`` does right after starting the child: the child's start-up
    (imports, the embedder's weights) then already runs at the class's priority."""
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    out: multiprocessing.Queue[tuple[int, int]] = context.Queue()
    proc = context.Process(target=_wait_and_report, args=(go, out))
    proc.start()
    try:
        assert "SCHED_IDLE" in lower_priority("batch", proc.pid)
        go.set()
        assert out.get(timeout=60) == (19, os.SCHED_IDLE)
    finally:
        proc.join(10)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller keeps its own
