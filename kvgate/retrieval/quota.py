"""Storage quotas: what a tenant may keep, counted in what is written.

An upload's bytes are only the start: its extracted text is kept, and each vector store that
holds the file keeps chunks of it with their BM25 terms and a float32 vector each (a 47 KB
docx grew the database by 21 MB; one file in 30 stores is indexed 30 times). So
``max_bytes`` (the tenants file's ``max_storage_bytes``) bounds the sum of all of it, each
part counted by ``DocStore`` in the transaction that writes it; ``max_chunks`` bounds the
chunks (one vector each) over the tenant's stores, ``max_store_bytes`` one store's chunks,
and ``max_stores`` the vector stores. An upload or a new store over a limit is refused
(400, ``storage_quota_exceeded``); an ingestion job whose text or chunks would pass one
fails with that code in its ``last_error``.

Bytes counted are the bytes of the data written (UTF-8 text, terms, 4 bytes a vector
element), not SQLite's pages around them: a 94 KB Chinese text in 1 and in 5 stores with
384-dimension vectors was counted 1.04 and 4.47 MB while the database grew 1.60 and 7.63 MB
(a chunk row of about 2.4 KB takes a 4 KiB page of its own), so disk use is up to about 1.7
times the quota.

The limits travel to the ingestion process through the database (``DocStore.set_limits``,
written whenever a job is queued), so a tenants file reloaded applies to the jobs queued
after it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvgate.errors import InvalidRequest


class StorageQuotaExceeded(InvalidRequest):
    code = "storage_quota_exceeded"


@dataclass(frozen=True)
class StorageLimits:
    """Per tenant (None: no limit). Bytes are bytes of storage: UTF-8 for text."""

    max_files: int | None = None
    #: Everything stored: uploads, extracted text, chunks with terms and vectors.
    max_bytes: int | None = None
    #: Chunks (each with one vector) over all the tenant's stores.
    max_chunks: int | None = None
    #: Vector stores.
    max_stores: int | None = None
    #: One store's chunks with their terms and vectors.
    max_store_bytes: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StorageLimits:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


@dataclass(frozen=True)
class StoredUsage:
    """What a tenant stores now."""

    files: int = 0
    upload_bytes: int = 0
    text_bytes: int = 0
    #: Bytes of chunks: text, terms, section path and vector.
    index_bytes: int = 0
    chunks: int = 0
    stores: int = 0

    @property
    def total_bytes(self) -> int:
        return self.upload_bytes + self.text_bytes + self.index_bytes


def _over(limit: int | None, value: int) -> bool:
    return limit is not None and value > limit


def check_upload(tenant: str, limits: StorageLimits, used: StoredUsage, size: int) -> None:
    """An upload of ``size`` bytes."""
    if _over(limits.max_files, used.files + 1):
        raise StorageQuotaExceeded(
            f"tenant {tenant!r} stores {used.files} files, its limit (max_files) is "
            f"{limits.max_files}; delete some first",
            param="file",
        )
    if _over(limits.max_bytes, used.total_bytes + size):
        raise StorageQuotaExceeded(
            f"tenant {tenant!r} stores {used.total_bytes} bytes (files, their text and "
            f"indexes); this file's {size} would pass its limit (max_storage_bytes) of "
            f"{limits.max_bytes}",
            param="file",
        )


def check_store(tenant: str, limits: StorageLimits, used: StoredUsage) -> None:
    """One more vector store."""
    if _over(limits.max_stores, used.stores + 1):
        raise StorageQuotaExceeded(
            f"tenant {tenant!r} has {used.stores} vector stores, its limit "
            f"(max_vector_stores) is {limits.max_stores}; delete some first",
        )


def check_room(tenant: str, limits: StorageLimits, used: StoredUsage, store_bytes: int) -> None:
    """Room left to index a file at all (before a job is queued): refused when the tenant
    (or the store, holding ``store_bytes``) is already at a limit."""
    if limits.max_bytes is not None and used.total_bytes >= limits.max_bytes:
        raise StorageQuotaExceeded(
            f"tenant {tenant!r} stores {used.total_bytes} bytes, its limit "
            f"(max_storage_bytes) is {limits.max_bytes}; delete files or vector stores first",
            param="file_id",
        )
    if limits.max_chunks is not None and used.chunks >= limits.max_chunks:
        raise StorageQuotaExceeded(
            f"tenant {tenant!r} stores {used.chunks} chunks, its limit (max_chunks) is "
            f"{limits.max_chunks}; delete files or vector stores first",
            param="file_id",
        )
    if limits.max_store_bytes is not None and store_bytes >= limits.max_store_bytes:
        raise StorageQuotaExceeded(
            f"the vector store holds {store_bytes} bytes, the limit (max_store_bytes) is "
            f"{limits.max_store_bytes}",
            param="file_id",
        )


def check_text(tenant: str, limits: StorageLimits, used: StoredUsage, text_bytes: int) -> None:
    """A file's extracted text of ``text_bytes`` (``used`` without any it had)."""
    if _over(limits.max_bytes, used.total_bytes + text_bytes):
        raise StorageQuotaExceeded(
            f"the file's text is {text_bytes} bytes; with the {used.total_bytes} tenant "
            f"{tenant!r} stores it would pass its limit (max_storage_bytes) of "
            f"{limits.max_bytes}"
        )


def check_chunks(
    tenant: str,
    limits: StorageLimits,
    used: StoredUsage,
    store_bytes: int,
    chunks: int,
    index_bytes: int,
) -> None:
    """A file's ``chunks`` of ``index_bytes`` into a store holding ``store_bytes`` (both
    figures without what the file had there)."""
    if _over(limits.max_chunks, used.chunks + chunks):
        raise StorageQuotaExceeded(
            f"the file makes {chunks} chunks; with the {used.chunks} tenant {tenant!r} "
            f"stores it would pass its limit (max_chunks) of {limits.max_chunks}"
        )
    if _over(limits.max_store_bytes, store_bytes + index_bytes):
        raise StorageQuotaExceeded(
            f"the file's chunks and vectors are {index_bytes} bytes; with the {store_bytes} "
            f"the vector store holds they would pass its limit (max_store_bytes) of "
            f"{limits.max_store_bytes}"
        )
    if _over(limits.max_bytes, used.total_bytes + index_bytes):
        raise StorageQuotaExceeded(
            f"the file's chunks and vectors are {index_bytes} bytes; with the "
            f"{used.total_bytes} tenant {tenant!r} stores they would pass its limit "
            f"(max_storage_bytes) of {limits.max_bytes}"
        )
