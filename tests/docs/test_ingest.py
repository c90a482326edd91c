"""The ingestion process's OS priority, set in a child so the test process keeps its own."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

import pytest

from kvgate.docs.ingest import lower_priority


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
def test_batch_ingestion_runs_under_sched_idle_and_its_threads_inherit_it() -> None:
    base = os.nice(0)
    got, nice, policy, thread_policy = _in_child("batch")
    assert policy == os.SCHED_IDLE and thread_policy == os.SCHED_IDLE
    assert nice == min(base + 19, 19)
    assert "SCHED_IDLE" in got and f"nice {nice}" in got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
def test_standard_ingestion_is_niced_but_keeps_the_normal_policy() -> None:
    base = os.nice(0)
    got, nice, policy, thread_policy = _in_child("standard")
    assert policy == os.SCHED_OTHER and thread_policy == os.SCHED_OTHER
    assert nice == min(base + 10, 19)
    assert got == f"nice {nice}"
