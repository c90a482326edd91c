"""What a server leaves on disk is its owner's only, whatever the umask: after uploads, an
indexed vector store and a chat (the documents database with its -wal and -shm, the
uploads, the usage ledger and its lock files), every file under the data directory is 0600
and every directory 0700; and storage quotas (stores, chunks) reach the client as OpenAI
errors before anything is added."""

from __future__ import annotations

import io
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_tenants_server

#: Outside the fast tier (scripts/test.sh --fast): servers started under several umasks.
pytestmark = pytest.mark.slow

TENANTS = """
[tenants.a]
keys = ["sk-a"]
max_vector_stores = 1
max_chunks = 1
"""


@pytest.fixture(params=[0o022, 0o000], ids=["umask-022", "umask-000"])
def at_rest(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[tuple[LiveServer, Path]]:
    """A server started (and its ingestion process spawned) under the umask: its data
    directory, made by the server, holds the usage ledger too."""
    data = tmp_path / "data"
    old = os.umask(request.param)
    try:
        live = start_tenants_server(
            tiny_llama_dir,
            TENANTS,
            tmp_path,
            data_dir=str(data),
            usage_db=str(data / "ledger" / "usage.sqlite3"),
        )
        try:
            yield live, data
        finally:
            live.stop()
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (itself included) -> its permission bits, and the bits a
    private one has (0700 a directory, 0600 anything else)."""
    found = {".": (stat.S_IMODE(root.stat().st_mode), 0o700)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            mode = (Path(folder) / name).lstat().st_mode
            want = 0o700 if stat.S_ISDIR(mode) else 0o600
            found[str((Path(folder) / name).relative_to(root))] = (stat.S_IMODE(mode), want)
    return found


def _wait_completed(client: openai.OpenAI, store_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout  # the ingestion process loads its embedder first
    while client.vector_stores.retrieve(store_id).status != "completed":
        assert time.monotonic() < deadline, "the vector store was not indexed"
        time.sleep(0.1)


def test_everything_under_the_data_directory_is_private(
    at_rest: tuple[LiveServer, Path],
) -> None:
    live, data = at_rest
    with openai.OpenAI(base_url=live.api_url, api_key="sk-a", max_retries=0) as client:
        made = client.files.create(
            file=("note.md", io.BytesIO("# 注\n\n第一条 测试。\n".encode())),
            purpose="assistants",
        )
        store = client.vector_stores.create(name="notes", file_ids=[made.id])
        with pytest.raises(openai.BadRequestError, match="max_vector_stores") as refused:
            client.vector_stores.create(name="one too many")
        assert refused.value.code == "storage_quota_exceeded"
        _wait_completed(client, store.id)
        # Its one chunk is all it may store: a batch of another file is refused whole.
        other = client.files.create(file=("more.md", io.BytesIO(b"# more")), purpose="assistants")
        with pytest.raises(openai.BadRequestError, match="max_chunks") as refused:
            client.vector_stores.file_batches.create(store.id, file_ids=[other.id])
        assert refused.value.code == "storage_quota_exceeded"
        assert [f.id for f in client.vector_stores.files.list(store.id)] == [made.id]
    r = httpx.post(
        f"{live.api_url}/chat/completions",
        headers={"Authorization": "Bearer sk-a"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    running = _modes(data)
    # What the walk must have seen, or it proves nothing.
    for written in ("docs.sqlite3", "docs.sqlite3-wal", "docs.sqlite3-shm",
                    f"files/{made.id}", "ledger/usage.sqlite3", "ledger/usage.sqlite3-wal",
                    "ledger/usage.sqlite3.owners"):  # fmt: skip
        assert written in running, sorted(running)
    live.stop()
    for modes in (running, _modes(data)):
        for path, (mode, want) in modes.items():
            assert mode == want, f"{path}: {mode:04o}"
