"""The usage ledger under a flood: how long a request's first token waits for its delivered
mark to be committed (``UsageLedger.delivered``), with and without a CPU-bound Python thread
beside the writer (the engine's Python work, in a server whose engine is a thread).

A flood of ``--in-flight`` requests: each round, a few end (settled) and as many are
admitted and marked delivered, every one reports progress; then one quiet request is
admitted and its delivered mark waited for (the wait measured).

    python bench/ledger.py                  # 30 s alone, then 30 s beside a busy thread
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from kvgate.governance.usage import Counts, UsageLedger


def flood(seconds: float, in_flight: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = UsageLedger(Path(tmp) / "usage.db")
        rows = [ledger.admit(f"f{i}", "flooder", "m", "v", 100) for i in range(in_flight)]
        waits: list[float] = []
        n, stop = in_flight, time.monotonic() + seconds
        while time.monotonic() < stop:
            for _ in range(6):
                i = random.randrange(len(rows))
                ledger.settle(rows[i], Counts(100, 64), "length", delivered=True)
                rows[i] = ledger.admit(f"f{n}", "flooder", "m", "v", 100)
                ledger.delivered(rows[i], Counts(100, 1))
                n += 1
            for row in rows:
                ledger.progress(row, Counts(100, random.randrange(64)))
            quiet = ledger.admit(f"q{n}", "quiet", "m", "v", 50)
            t0 = time.monotonic()
            ledger.delivered(quiet, Counts(50, 1)).result()
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        ledger.close()
    return sorted(waits)


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def report(title: str, waits: list[float]) -> None:
    p50, p99 = waits[len(waits) // 2], waits[int(len(waits) * 0.99)]
    print(
        f"{title:<28} delivered mark waited p50 {p50 * 1000:6.1f} ms, p99 {p99 * 1000:6.1f} ms, "
        f"max {waits[-1] * 1000:6.1f} ms ({len(waits)} marks)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--in-flight", type=int, default=128)
    a = ap.parse_args()
    report("alone", flood(a.seconds, a.in_flight))
    stop = threading.Event()
    thread = threading.Thread(target=busy, args=(stop,), daemon=True)
    thread.start()
    report("beside a busy Python thread", flood(a.seconds, a.in_flight))
    stop.set()


if __name__ == "__main__":
    main()
