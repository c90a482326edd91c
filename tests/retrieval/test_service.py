"""The documents service on its own, with a small deterministic embedder: ingestion,
search, filters, removal, and indexes rebuilt from the database after a restart; each on
SQLite and on PostgreSQL."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvgate.retrieval.ingest import chunks_of
from kvgate.retrieval.service import DocsService, NotFound, StorageLimits, StorageQuotaExceeded
from kvgate.retrieval.store import DocStore

LAW = (
    "# 示例法\n\n## 第一章 总则\n\n第一条 为了保护劳动者的合法权益，制定本法。\n\n"
    "第二条 用人单位应当依法支付工资。\n\n## 第二章 休假\n\n"
    "第三条 职工累计工作满一年的，享受带薪年休假。\n\n第四条 年休假在一个年度内可以集中安排。\n"
)


class CharEmbedder:
    """Bags of characters, hashed into 64 dimensions: similar texts, similar vectors."""

    dim = 64

    def _vector(self, text: str) -> np.ndarray:
        v = np.zeros(self.dim, dtype=np.float32)
        for ch in text:
            v[hashlib.blake2b(ch.encode(), digest_size=2).digest()[0] % self.dim] += 1
        return v / max(float(np.linalg.norm(v)), 1e-9)

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self._vector(t) for t in texts]).reshape(len(texts), self.dim)

    def query(self, text: str) -> np.ndarray:
        return self._vector(text)

    def count_tokens(self, text: str) -> int:
        return len(text)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def docs_url(request: pytest.FixtureRequest) -> str | None:
    """Every test here on each database: SQLite (the default) and PostgreSQL."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("postgres_db")
    return url


def _service(directory: Path, url: str | None, **limits: int) -> DocsService:
    return DocsService(DocStore(directory, url), CharEmbedder, lambda _: StorageLimits(**limits))


def _upload(docs: DocsService, tmp: Path, tenant: str, name: str, data: bytes) -> str:
    path = tmp / f"upload-{name}"
    path.write_bytes(data)
    return docs.add_file(tenant, name, "assistants", path).id


def test_ingest_search_and_rebuild_after_a_restart(tmp_path: Path, docs_url: str | None) -> None:
    docs = _service(tmp_path / "data", docs_url)
    file_id = _upload(docs, tmp_path, "t", "law.md", LAW.encode())
    store = docs.create_store("t", "laws", [file_id], {"type": "auto"}, {})
    assert docs.wait_idle()
    assert docs.store.counts(store.id) == {
        "in_progress": 0, "completed": 1, "failed": 0, "cancelled": 0, "total": 1,
    }  # fmt: skip
    hits = docs.search("t", [store.id], "带薪年休假 累计工作满一年", 2)
    assert hits[0].attributes["section"] == "示例法 / 第二章 休假 / 第三条"
    a, b = hits[0].attributes["start"], hits[0].attributes["end"]
    assert LAW[a:b] == hits[0].text
    before = [(h.file_id, h.text) for h in docs.search("t", [store.id], "工资", 4)]
    docs.close()
    # Nothing embedded again: the index comes from the database.
    again = _service(tmp_path / "data", docs_url)
    assert [(h.file_id, h.text) for h in again.search("t", [store.id], "工资", 4)] == before
    again.close()


ITEMS = (
    "# 示例法\n\n第一条 本法适用于用人单位。\n\n"
    "第二条 劳动者有下列情形之一的，用人单位不得解除劳动合同：\n\n"
    "（一）从事接触职业病危害作业的；\n\n（二）女职工在孕期、产期、哺乳期的；\n\n"
    "（三）在本单位连续工作满十五年的。\n"
)


def test_auto_chunks_keep_paragraph_vectors_through_a_restart(
    tmp_path: Path, docs_url: str | None
) -> None:
    """An ``auto`` chunk of several paragraphs is stored with its whole vector and one per
    paragraph after its first; a ``static`` window with one. The index rebuilt from the
    database after a restart scores exactly as the one built at ingestion."""
    docs = _service(tmp_path / "data", docs_url)
    file_id = _upload(docs, tmp_path, "t", "items.md", ITEMS.encode())
    auto = docs.create_store("t", "auto", [file_id], {"type": "auto"}, {})
    static = {"max_chunk_size_tokens": 400, "chunk_overlap_tokens": 0}
    flat = docs.create_store("t", "static", [file_id], {"type": "static", "static": static}, {})
    assert docs.wait_idle()
    rows = {c.chunk.section[-1]: c.vector.size // 64 for c in docs.store.chunks(auto.id)}
    assert rows == {"第一条": 1, "第二条": 4}
    assert [c.vector.size // 64 for c in docs.store.chunks(flat.id)] == [1]
    query = "孕期、产期、哺乳期的女职工"
    before = [(h.text, h.score) for h in docs.search("t", [auto.id], query, 2)]
    assert before[0][0].startswith("第二条")
    docs.close()
    again = _service(tmp_path / "data", docs_url)
    assert [(h.text, h.score) for h in again.search("t", [auto.id], query, 2)] == before
    again.close()


def test_filters_removal_and_ownership(tmp_path: Path, docs_url: str | None) -> None:
    docs = _service(tmp_path / "data", docs_url)
    one = _upload(docs, tmp_path, "t", "one.md", LAW.encode())
    two = _upload(docs, tmp_path, "t", "two.md", "第一条 年休假的规定。\n".encode())
    store = docs.create_store("t", None, [], {"type": "auto"}, {})
    docs.add_store_file("t", store.id, one, None, {"year": 2024})
    docs.add_store_file("t", store.id, two, None, {"year": 2020})
    assert docs.wait_idle()
    newer = {"type": "gte", "key": "year", "value": 2021}
    assert {h.file_id for h in docs.search("t", [store.id], "年休假", 10, newer)} == {one}
    either = {
        "type": "or",
        "filters": [newer, {"type": "eq", "key": "filename", "value": "two.md"}],
    }
    assert {h.file_id for h in docs.search("t", [store.id], "年休假", 10, either)} == {one, two}
    with pytest.raises(NotFound):
        docs.search("other", [store.id], "年休假")
    with pytest.raises(NotFound):
        docs.file("other", one)
    assert docs.search(None, [store.id], "年休假")  # an admin
    docs.remove_store_file("t", store.id, two)
    assert {h.file_id for h in docs.search("t", [store.id], "年休假", 10)} == {one}
    docs.delete_file("t", one)
    assert docs.search("t", [store.id], "年休假", 10) == []
    docs.delete_store("t", store.id)
    with pytest.raises(NotFound):
        docs.vector_store("t", store.id)
    docs.close()


def test_quotas_count_a_tenants_files_only(tmp_path: Path, docs_url: str | None) -> None:
    docs = _service(tmp_path / "data", docs_url, max_files=1)
    _upload(docs, tmp_path, "t", "a.md", b"a")
    _upload(docs, tmp_path, "u", "b.md", b"b")  # another tenant's count
    with pytest.raises(StorageQuotaExceeded, match="max_files"):
        _upload(docs, tmp_path, "t", "c.md", b"c")
    assert not (tmp_path / "upload-c.md").exists()  # the refused upload is not kept
    docs.close()


def _failed(docs: DocsService, store_id: str, file_id: str) -> dict[str, str]:
    record = docs.store.store_file(store_id, file_id)
    assert record is not None and record.status == "failed" and record.last_error, record
    return record.last_error


@pytest.mark.slow
def test_one_file_in_many_stores_counts_each_stores_chunks(
    tmp_path: Path, docs_url: str | None
) -> None:
    """The audit's probe in small: one file put in store after store was indexed again each
    time while the quota still said "1 file". Each store's chunks count, and the number of
    stores is limited; a refusal leaves nothing behind."""
    k = len(chunks_of(LAW, {"type": "auto"}, len))
    docs = _service(tmp_path / "data", docs_url, max_chunks=k, max_stores=3)
    file_id = _upload(docs, tmp_path, "t", "law.md", LAW.encode())
    first = docs.create_store("t", "one", [file_id], {"type": "auto"}, {})
    assert docs.wait_idle()
    used = docs.store.usage("t")
    # Each chunk's vector is stored with it: 64 float32s of CharEmbedder's.
    assert used.chunks == k and used.index_bytes == docs.store.usage_bytes(first.id) > k * 64 * 4
    with pytest.raises(StorageQuotaExceeded, match="max_chunks") as refused:
        docs.create_store("t", "two", [file_id], {"type": "auto"}, {})
    assert refused.value.code == "storage_quota_exceeded"
    assert [s.id for s in docs.store.stores("t")] == [first.id]  # no empty store left
    second = docs.create_store("t", "two", [], {"type": "auto"}, {})
    with pytest.raises(StorageQuotaExceeded, match="max_chunks"):
        docs.add_store_file("t", second.id, file_id, None, {})
    docs.create_store("t", "three", [], {"type": "auto"}, {})
    with pytest.raises(StorageQuotaExceeded, match="max_vector_stores"):
        docs.create_store("t", "four", [], {"type": "auto"}, {})
    docs.create_store("u", "theirs", [], {"type": "auto"}, {})  # another tenant's count
    docs.delete_store("t", first.id)  # frees its chunks
    assert docs.store.usage("t").chunks == 0
    docs.add_store_file("t", second.id, file_id, None, {})
    assert docs.wait_idle()
    assert docs.store.counts(second.id)["completed"] == 1
    docs.close()


@pytest.mark.slow
def test_a_job_whose_text_or_chunks_would_pass_the_quota_fails_with_its_error(
    tmp_path: Path, docs_url: str | None
) -> None:
    """Extracted text, chunks and their vectors count where they are written, in the
    ingestion process: a job over a limit fails with ``storage_quota_exceeded`` in its
    ``last_error`` and writes nothing."""
    data = LAW.encode()
    limits: dict[str, StorageLimits] = {}
    docs = DocsService(
        DocStore(tmp_path / "data", docs_url),
        CharEmbedder,
        lambda t: limits.get(t, StorageLimits()),
    )
    probe = docs.create_store("probe", None, [_upload(docs, tmp_path, "probe", "l.md", data)],
                              {"type": "auto"}, {})  # fmt: skip
    assert docs.wait_idle()
    index = docs.store.usage_bytes(probe.id)  # one store's chunks of LAW, vectors included
    text = len(data)  # a .md's text is its bytes
    limits["text"] = StorageLimits(max_bytes=len(data) + text - 1)
    limits["store"] = StorageLimits(max_store_bytes=index - 1)
    limits["total"] = StorageLimits(max_bytes=len(data) + text + index - 1)
    jobs = {}
    for tenant in limits:
        file_id = _upload(docs, tmp_path, tenant, f"{tenant}.md", data)
        jobs[tenant] = (
            docs.create_store(tenant, None, [file_id], {"type": "auto"}, {}).id,
            file_id,
        )
    assert docs.wait_idle()
    for tenant, limit in (("text", "max_storage_bytes"), ("store", "max_store_bytes"),
                          ("total", "max_storage_bytes")):  # fmt: skip
        error = _failed(docs, *jobs[tenant])
        assert error["code"] == "storage_quota_exceeded" and limit in error["message"], error
        used = docs.store.usage(tenant)
        assert used.chunks == 0 and used.index_bytes == 0
    text_file = docs.store.file(jobs["text"][1], None)
    assert text_file is not None and text_file.text is None  # the text was not kept
    assert docs.store.usage("text").text_bytes == 0
    assert docs.store.usage("total").text_bytes == text  # kept: within the limit
    # An upload counts against what is stored in all, the text included: bytes enough for
    # one more upload of LAW's size by the files alone are refused.
    with pytest.raises(StorageQuotaExceeded, match="max_storage_bytes"):
        _upload(docs, tmp_path, "total", "more.md", b"x" * (index + text // 2))
    docs.close()


@pytest.mark.slow
def test_context_expansion_stays_under_the_heading(tmp_path: Path, docs_url: str | None) -> None:
    docs = _service(tmp_path / "data", docs_url)
    file_id = _upload(docs, tmp_path, "t", "law.md", LAW.encode())
    store = docs.create_store("t", None, [file_id], {"type": "auto"}, {})
    assert docs.wait_idle()
    (hit,) = [h for h in docs.search("t", [store.id], "带薪年休假", 4) if "第三条" in h.text[:4]]
    wide = docs.expand(hit, 1)
    # 第四条 follows under the same chapter; 第二条, before it, is under another.
    assert wide.text.startswith("第三条") and wide.text.endswith("可以集中安排。")
    assert LAW[wide.attributes["start"] : wide.attributes["end"]] == wide.text
    assert wide.attributes["section"] == hit.attributes["section"]
    docs.close()


class SlowEmbedder(CharEmbedder):
    def passages(self, texts: Sequence[str]) -> np.ndarray:
        import time

        time.sleep(0.5)
        return super().passages(texts)


@pytest.mark.slow
def test_a_dead_ingestion_process_fails_its_job_and_is_started_again(
    tmp_path: Path, docs_url: str | None
) -> None:
    docs = DocsService(DocStore(tmp_path / "data", docs_url), SlowEmbedder)
    long_law = "\n\n".join(f"第{i}条 内容{i}。" for i in range(1, 200))
    file_id = _upload(docs, tmp_path, "t", "long.md", long_law.encode())
    store = docs.create_store("t", None, [file_id], {"type": "auto"}, {})
    deadline = time.monotonic() + 60
    while docs.store.counts(store.id)["in_progress"] and time.monotonic() < deadline:
        pid = docs._worker.pid
        if pid is not None and docs.store.file(file_id, None).text is not None:  # type: ignore[union-attr]
            os.kill(
                pid, signal.SIGKILL
            )  # mid-job: its text is extracted, its chunks not yet written
            break
        time.sleep(0.05)
    assert docs.wait_idle(30)
    (record,) = docs.store.store_files(store.id)
    assert record.status == "failed" and record.last_error is not None
    assert "ingestion process died" in record.last_error["message"]
    assert "SIGKILL" in record.last_error["message"]
    # The next job gets a new process.
    small = _upload(docs, tmp_path, "t", "small.md", "第一条 年休假。".encode())
    docs.add_store_file("t", store.id, small, None, {})
    assert docs.wait_idle(30)
    assert docs.store.store_file(store.id, small).status == "completed"  # type: ignore[union-attr]
    docs.close()


@pytest.mark.slow
def test_a_file_added_again_mid_job_keeps_only_the_new_jobs_chunks(
    tmp_path: Path, docs_url: str | None
) -> None:
    docs = DocsService(DocStore(tmp_path / "data", docs_url), SlowEmbedder)
    law = "\n\n".join(f"第{i}条 内容{i}。" for i in range(1, 60))
    file_id = _upload(docs, tmp_path, "t", "law.md", law.encode())
    static = {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 0}}
    store = docs.create_store("t", None, [file_id], static, {})
    time.sleep(1.0)  # the first job is embedding its batches
    docs.add_store_file("t", store.id, file_id, {"type": "auto"}, {})
    assert docs.wait_idle(60)
    (record,) = docs.store.store_files(store.id)
    assert record.status == "completed" and record.chunking == {"type": "auto"}
    rows = list(docs.store.chunks(store.id))
    assert len(rows) == 59 and all(r.chunk.section for r in rows)  # one per article, auto's
    hits = docs.search("t", [store.id], "内容7", 100)
    assert len(hits) == len({h.key for h in hits}) <= 59
    docs.close()


@pytest.mark.slow
def test_replicas_on_one_postgres_store_see_each_others_work(
    tmp_path: Path, postgres_db: str
) -> None:
    """Two services (two replicas' worth) on one PostgreSQL database, each with its own
    folder, ingestion process and in-process index: what one ingests or removes, the other
    searches at once; ownership holds across them."""
    a = _service(tmp_path / "a", postgres_db)
    b = _service(tmp_path / "b", postgres_db)
    file_id = _upload(a, tmp_path, "t", "law.md", LAW.encode())
    store = a.create_store("t", "laws", [file_id], {"type": "auto"}, {})
    assert a.wait_idle()
    assert b.store.file_bytes(file_id) == LAW.encode()  # the bytes are in the database
    (hit, *_) = b.search("t", [store.id], "带薪年休假 累计工作满一年", 2)
    assert hit.attributes["section"] == "示例法 / 第二章 休假 / 第三条"
    with pytest.raises(NotFound):
        b.search("other", [store.id], "年休假")
    # b adds a file; a, whose index is already built, searches it without a restart.
    overtime = "第一条 加班费按照工资的百分之一百五十支付。\n".encode()
    other = _upload(b, tmp_path, "t", "other.md", overtime)
    b.add_store_file("t", store.id, other, None, {})
    assert b.wait_idle()
    assert a.search("t", [store.id], "加班费", 1)[0].file_id == other
    b.delete_file("t", other)
    assert other not in {h.file_id for h in a.search("t", [store.id], "加班费", 10)}
    a.close()
    b.close()


@pytest.mark.slow
def test_a_replica_takes_over_jobs_whose_lease_ran_out(tmp_path: Path, postgres_db: str) -> None:
    """A job whose replica stopped renewing its lease is started again by another replica;
    one whose lease is fresh is left to its owner."""
    from kvgate.retrieval.service import LEASE_S

    seed = _service(tmp_path / "seed", postgres_db)
    dead = _upload(seed, tmp_path, "t", "dead.md", LAW.encode())
    live = _upload(seed, tmp_path, "t", "live.md", LAW.encode())
    store = seed.store.add_store("t", None, {"type": "auto"}, {})
    seed.close()
    rows = DocStore(tmp_path / "rows", postgres_db)  # jobs queued by replicas not running
    orphan = rows.add_store_file(store.id, dead, {"type": "auto"}, {})
    held = rows.add_store_file(store.id, live, {"type": "auto"}, {})
    rows._write(
        "UPDATE store_files SET beat_at = ? WHERE job = ?",
        (int(time.time() - LEASE_S - 5), orphan.job),
    )
    rows.close()
    docs = _service(tmp_path / "b", postgres_db)
    assert docs.wait_idle()
    taken = docs.store.store_file(store.id, dead)
    left = docs.store.store_file(store.id, live)
    assert taken is not None and taken.status == "completed" and taken.job != orphan.job
    assert left is not None and left.status == "in_progress" and left.job == held.job
    docs.close()


def test_a_docs_url_of_another_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="postgresql://"):
        DocStore(tmp_path, "mysql://user@host/db")
