"""How long tenant alpha's small file waits behind tenant beta's large ones.

    PYTHONPATH=<tree> python bench/ingest_wait.py [--scenario docx,pdf,many] [--give-up 180]

The documents service alone (kvgate/retrieval, the e5 embedder, a SQLite store in a temporary
folder): beta queues its files, then alpha queues one 38-byte file into a store of its
own; printed is alpha's wait, from its queueing to its ``completed``, and how each of
beta's files ended. Scenarios: ``docx`` (a 10-million-character .docx), ``pdf`` (99,000
pages, one shared page), ``many`` (four .md files of 15,000 characters each), ``alone``
(no file of beta's: the ingestion process's start and the small file's own time). Runs against
any tree's kvgate (``PYTHONPATH``): main's, to compare. A wait past ``--give-up`` seconds is
printed as "> N s".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvgate.retrieval.retrieval import E5Embedder
from kvgate.retrieval.service import DocsService
from kvgate.retrieval.store import DocStore

_HEAVY = Path(__file__).resolve().parents[1] / "tests" / "docs" / "heavy_files.py"


def _heavy() -> object:
    """tests/retrieval/heavy_files.py of this tree, whichever kvgate is imported."""
    spec = importlib.util.spec_from_file_location("heavy_files", _HEAVY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _law(chars: int, seed: int) -> bytes:
    """Articles of random CJK text (第N条 every ~300 characters): ``chars`` characters."""
    codes = np.random.default_rng(seed).integers(0x4E00, 0x4E00 + 3000, chars, dtype=np.uint32)
    text = codes.tobytes().decode("utf-32-le")
    parts = [f"第{i // 300 + 1}条 {text[i : i + 300]}。" for i in range(0, chars, 300)]
    return "\n\n".join(parts).encode()


def scenarios() -> dict[str, Callable[[], list[tuple[str, bytes]]]]:
    heavy = _heavy()
    return {
        "docx": lambda: [("long.docx", heavy.long_docx(10_000_000))],  # type: ignore[attr-defined]
        "pdf": lambda: [("big.pdf", heavy.pdf_of_pages(99_000))],  # type: ignore[attr-defined]
        "many": lambda: [(f"law{i}.md", _law(15_000, i)) for i in range(4)],
        "alone": lambda: [],
    }


def _upload(docs: DocsService, folder: Path, tenant: str, name: str, data: bytes) -> str:
    path = folder / f"upload-{tenant}-{name}"
    path.write_bytes(data)
    return docs.add_file(tenant, name, "assistants", path).id


def run(name: str, files: list[tuple[str, bytes]], give_up: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        docs = DocsService(DocStore(folder / "data", None), E5Embedder)
        beta_ids = [_upload(docs, folder, "beta", n, d) for n, d in files]
        beta = docs.create_store("beta", None, beta_ids, {"type": "auto"}, {})
        small = _upload(docs, folder, "alpha", "a.md", "第一条 甲方的小文件。".encode())
        queued = time.monotonic()
        alpha = docs.create_store("alpha", None, [small], {"type": "auto"}, {})
        wait = None
        while time.monotonic() - queued < give_up:
            record = docs.store.store_file(alpha.id, small)
            if record is not None and record.status != "in_progress":
                wait = time.monotonic() - queued
                break
            time.sleep(0.1)
        ends = []
        for file_id, (filename, _) in zip(beta_ids, files, strict=True):
            record = docs.store.store_file(beta.id, file_id)
            status = "?" if record is None else record.status
            error = (record.last_error or {}).get("message", "") if record else ""
            ends.append(f"{filename}: {status}" + (f" ({error})" if error else ""))
        shown = f"{wait:.1f} s" if wait is not None else f"> {give_up:.0f} s"
        print(f"{name}: alpha's small file waited {shown}; beta's at that time: {'; '.join(ends)}")
        docs.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", default="alone,docx,pdf,many")
    p.add_argument("--give-up", type=float, default=180.0)
    a = p.parse_args()
    import kvgate

    print(f"kvgate from {os.path.dirname(kvgate.__file__)}; {platform.processor() or '?'}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    table = scenarios()
    for name in a.scenario.split(","):
        run(name, table[name](), a.give_up)


if __name__ == "__main__":
    main()
