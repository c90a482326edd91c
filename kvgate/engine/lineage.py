"""Lineage: an id for each served model version, derived from what it is.

The id is a digest over the weights (the sha256 of every file the checkpoint was read
from), the model's config, the engine settings that change its outputs or their speed
(dtype, quantization, context, block size, kernels), and kvgate's version. The same
weights under the same settings give the same id on every replica and after every
restart; any change gives another. ``created`` is the weights' modification time (the same
everywhere the files are the same), ``source`` where they were read from.

Hashing reads the weights once more at load: ~0.3 s for SmolLM2's 100 MB on the
development machine (AMD EPYC, AVX2), 1.5 s for Qwen2.5-1.5B's 1.1 GB, a few seconds for a
model of several GB. So the digest is kept (``$KVGATE_DIGEST_CACHE``, else
``~/.cache/kvgate/digests``) under the source's path and every file's size, modification
time (ns) and inode, as ``git status`` trusts its index: a restart with the files untouched
reads none of them; any change to a file's stat hashes them all again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvgate

log = logging.getLogger("kvgate.engine")

#: Engine settings that are part of a version (others, e.g. threads or queue length, are
#: how it is run, not what it is).
VERSIONED_SETTINGS = (
    "dtype", "quantization", "gguf_blocks", "max_model_len", "block_size", "native_kernels",
    "kv_cache_dtype",
)  # fmt: skip


@dataclass(frozen=True)
class ModelVersion:
    id: str  # "<name>-<12 hex>"
    digest: str  # sha256 hex of everything below
    weights_sha256: str
    created: int  # unix seconds
    source: str


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def digest_cache_dir() -> Path:
    """``$KVGATE_DIGEST_CACHE``, else ``~/.cache/kvgate/digests``."""
    root = os.environ.get("KVGATE_DIGEST_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvgate" / "digests"


def weights_digest(source: str) -> tuple[str, int]:
    """The sha256 over every file of ``source`` (a file, or a directory's files by relative
    path), and the newest file's modification time: from the digest cache when no file's
    stat changed since it was computed."""
    root = Path(source)
    files = _files(root)
    stats = [
        [str(f.relative_to(root)) if root.is_dir() else f.name, s.st_size, s.st_mtime_ns, s.st_ino]
        for f in files
        for s in (os.stat(f),)
    ]
    key = hashlib.sha256(json.dumps([str(root.resolve()), stats]).encode()).hexdigest()
    entry = digest_cache_dir() / f"{key}.json"
    try:
        cached = json.loads(entry.read_text())
        if cached["stats"] == stats:
            return str(cached["sha256"]), int(cached["created"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: hash
    digest, created = _hash_files(root, files)
    _remember(entry, {"source": str(root), "stats": stats, "sha256": digest, "created": created})
    return digest, created


def _remember(entry: Path, value: dict[str, Any]) -> None:
    """Write a cache entry atomically; a cache that cannot be written only costs the hash."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False) as tmp:
            json.dump(value, tmp)
        os.replace(tmp.name, entry)
    except OSError as exc:
        log.debug("weights digest not cached (%s)", exc)


def _hash_files(root: Path, files: list[Path]) -> tuple[str, int]:
    h = hashlib.sha256()
    newest = 0
    for f in files:
        h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
        with open(f, "rb") as stream:
            while chunk := stream.read(1 << 20):
                h.update(chunk)
        newest = max(newest, int(os.stat(f).st_mtime))
    return h.hexdigest(), newest


def model_version(name: str, source: str, model_config: Any, engine_settings: Any) -> ModelVersion:
    weights, created = weights_digest(source)
    settings = {k: getattr(engine_settings, k, None) for k in VERSIONED_SETTINGS}
    is_instance = dataclasses.is_dataclass(model_config) and not isinstance(model_config, type)
    config = dataclasses.asdict(model_config) if is_instance else {}
    described = {
        "weights_sha256": weights,
        "model_config": config,
        "engine": settings,
        "kvgate": kvgate.__version__,
    }
    blob = json.dumps(described, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(blob).hexdigest()
    return ModelVersion(f"{name}-{digest[:12]}", digest, weights, created, source)
