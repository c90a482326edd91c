"""The ingestion process under its limits: a file that passes one fails alone, with why, and
another tenant's file queued behind it completes; the process never outlives the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvgate.retrieval.bounds import IngestLimits
from kvgate.retrieval.ingest_process import rss_bytes
from kvgate.retrieval.retrieval import Embedder
from kvgate.retrieval.service import DocsService
from kvgate.retrieval.store import DocStore
from tests.retrieval.heavy_files import docx_bomb, long_docx, pdf_of_pages
from tests.retrieval.test_service import CharEmbedder

#: Outside the fast tier (scripts/test.sh --fast): the ingestion process past its limits.
pytestmark = pytest.mark.slow

MiB = 2**20
#: Seconds any wait here may take: generous, for a loaded machine (the waits end as soon
#: as what they wait for is so).
DEADLINE_S = 240.0


class NeverEmbedder(CharEmbedder):
    """Never ends a batch that holds the word "forever" (a job only a limit stops)."""

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        if any("forever" in t for t in texts):
            while True:
                time.sleep(3600)
        return super().passages(texts)


class Recording(DocsService):
    """The service, noting the order in which jobs end (their file ids)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.ended: list[str] = []
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _job_done(self, job: tuple[str, str, str]) -> None:
        self.ended.append(job[1])
        super()._job_done(job)


def _service(
    directory: Path, limits: IngestLimits, embedder: Callable[[], Embedder] = CharEmbedder
) -> Recording:
    return Recording(DocStore(directory, None), embedder, ingest_limits=limits)


def _upload(docs: DocsService, tmp: Path, tenant: str, name: str, data: bytes) -> str:
    path = tmp / f"upload-{tenant}-{name}"
    path.write_bytes(data)
    return docs.add_file(tenant, name, "assistants", path).id


def _error(docs: DocsService, store_id: str, file_id: str) -> dict[str, str]:
    record = docs.store.store_file(store_id, file_id)
    assert record is not None and record.status == "failed", record
    assert record.last_error is not None
    for dump in ("Error:", "Exception", "Traceback", "<class"):
        assert dump not in record.last_error["message"]
    return record.last_error


def _completed(docs: DocsService, store_id: str, file_id: str) -> bool:
    record = docs.store.store_file(store_id, file_id)
    return record is not None and record.status == "completed"


HEAVY = {
    "docx bomb": ("bomb.docx", lambda: docx_bomb(1100 * MiB), "inflates to more than"),
    "99,000 pages": ("big.pdf", lambda: pdf_of_pages(99_000), "more than 5,000 pages"),
    "10 M characters": ("long.docx", lambda: long_docx(10_000_000), "2,000,000 characters"),
}


@pytest.mark.parametrize("kind", list(HEAVY))
def test_a_heavy_file_fails_alone_and_another_tenants_small_file_goes_next(
    tmp_path: Path, kind: str
) -> None:
    """beta queues the heavy file and a small one, then alpha a small one: the heavy file
    fails with ``file_too_complex`` and why; alpha's goes next (before beta's second), and
    beta's small file completes too; the process's peak RSS stays under its cap."""
    name, build, says = HEAVY[kind]
    limits = IngestLimits()
    docs = _service(tmp_path / "data", limits)
    heavy = _upload(docs, tmp_path, "beta", name, build())
    beta_small = _upload(docs, tmp_path, "beta", "b.md", "第一条 乙方的文件。".encode())
    alpha_small = _upload(docs, tmp_path, "alpha", "a.md", "第一条 甲方的文件。".encode())
    beta = docs.create_store("beta", None, [heavy, beta_small], {"type": "auto"}, {})
    alpha = docs.create_store("alpha", None, [alpha_small], {"type": "auto"}, {})
    assert docs.wait_idle(DEADLINE_S)
    error = _error(docs, beta.id, heavy)
    assert error["code"] == "file_too_complex" and says in error["message"]
    assert _completed(docs, alpha.id, alpha_small) and _completed(docs, beta.id, beta_small)
    assert docs.ended.index(alpha_small) < docs.ended.index(beta_small)
    pid = docs._worker.pid
    assert pid is not None  # the same process ran all three: the heavy file did not kill it
    peak = rss_bytes(pid, "VmHWM")
    assert peak is not None and peak < limits.memory_bytes
    docs.close()


def test_a_job_past_its_time_is_stopped_and_the_next_one_runs(tmp_path: Path) -> None:
    docs = _service(tmp_path / "data", IngestLimits(job_seconds=5), NeverEmbedder)
    slow = _upload(docs, tmp_path, "beta", "slow.md", "第一条 forever。".encode())
    small = _upload(docs, tmp_path, "alpha", "a.md", "第一条 甲方的文件。".encode())
    beta = docs.create_store("beta", None, [slow], {"type": "auto"}, {})
    alpha = docs.create_store("alpha", None, [small], {"type": "auto"}, {})
    assert docs.wait_idle(DEADLINE_S)
    error = _error(docs, beta.id, slow)
    assert error["code"] == "file_too_complex"
    assert "took longer than the 5 s" in error["message"]
    assert _completed(docs, alpha.id, small)
    docs.close()


def test_a_bomb_past_the_zip_checks_fails_by_the_memory_limit(tmp_path: Path) -> None:
    """With the zip checks off, python-docx inflates the bomb: the process's data limit
    stops it (or, failing that, the server's RSS watch); the file fails alone."""
    limits = IngestLimits(max_unzipped_bytes=2**40, max_zip_ratio=1e12, memory_bytes=1024 * MiB)
    docs = _service(tmp_path / "data", limits)
    bomb = _upload(docs, tmp_path, "beta", "bomb.docx", docx_bomb(1100 * MiB))
    small = _upload(docs, tmp_path, "alpha", "a.md", "第一条 甲方的文件。".encode())
    beta = docs.create_store("beta", None, [bomb], {"type": "auto"}, {})
    alpha = docs.create_store("alpha", None, [small], {"type": "auto"}, {})
    assert docs.wait_idle(DEADLINE_S)
    error = _error(docs, beta.id, bomb)
    assert error["code"] == "file_too_complex" and "memory" in error["message"]
    assert _completed(docs, alpha.id, small)
    pid = docs._worker.pid
    assert pid is not None
    peak = rss_bytes(pid, "VmHWM")
    assert peak is not None and peak < limits.memory_bytes
    docs.close()


_SERVER = """
import sys, time
from pathlib import Path
from kvgate.retrieval.bounds import IngestLimits
from kvgate.retrieval.service import DocsService
from kvgate.retrieval.store import DocStore
from tests.retrieval.test_ingest_process import NeverEmbedder
tmp = Path(sys.argv[1])
docs = DocsService(DocStore(tmp / "data", None), NeverEmbedder, ingest_limits=IngestLimits())
(tmp / "f.md").write_text("第一条 forever。")
record = docs.add_file("t", "f.md", "assistants", tmp / "f.md")
docs.create_store("t", None, [record.id], {"type": "auto"}, {})
while docs._worker.running is None:
    time.sleep(0.05)
print(docs._worker.pid, flush=True)
time.sleep(3600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line for line in status)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ingestion_process_dies_with_a_killed_server(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert server.stdout is not None
        child = int(server.stdout.readline())  # the ingestion process, running a job
        assert not _gone(child)
        server.send_signal(signal.SIGKILL)
        server.wait(60)
        deadline = time.monotonic() + DEADLINE_S
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child)
    finally:
        server.kill()
        server.wait(60)
        if server.stdout is not None:
            server.stdout.close()
