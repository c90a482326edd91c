"""OpenAI's Vector Stores API: stores, their files (indexed in the background; per-file
``status`` and ``last_error``), file batches, and ``search``. A store belongs to the tenant
whose key created it and holds only that tenant's files; others get 404."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from kvgate.errors import InvalidRequest
from kvgate.retrieval import filters as attribute_filters
from kvgate.retrieval.query import rewrite
from kvgate.retrieval.service import DocsService, NotFound, chunking_of
from kvgate.retrieval.store import StoreFileRecord, StoreRecord, new_id
from kvgate.server.door import charge
from kvgate.server.files import Docs, Who, page

Scalar = str | int | float | bool


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class CreateStore(_Body):
    name: str | None = None
    file_ids: list[str] = Field(default_factory=list, max_length=500)
    chunking_strategy: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None


class ModifyStore(_Body):
    name: str | None = None
    metadata: dict[str, str] | None = None


class AddStoreFile(_Body):
    file_id: str
    chunking_strategy: dict[str, Any] | None = None
    attributes: dict[str, Scalar] | None = Field(default=None, max_length=16)


class AddFileBatch(_Body):
    file_ids: list[str] = Field(min_length=1, max_length=500)
    chunking_strategy: dict[str, Any] | None = None
    attributes: dict[str, Scalar] | None = Field(default=None, max_length=16)


class RankingOptions(_Body):
    ranker: str | None = None
    score_threshold: float | None = Field(default=None, ge=0, le=1)


class Search(_Body):
    query: str | list[str]
    max_num_results: int = Field(default=10, ge=1, le=50)
    filters: dict[str, Any] | None = None
    rewrite_query: bool = False
    ranking_options: RankingOptions | None = None
    #: kvgate's: which retriever ranks (``hybrid``, or one alone, to compare them).
    retriever: Literal["hybrid", "bm25", "dense"] = "hybrid"


def store_object(docs: DocsService, record: StoreRecord) -> dict[str, Any]:
    counts = docs.store.counts(record.id)
    return {
        "id": record.id,
        "object": "vector_store",
        "created_at": record.created_at,
        "name": record.name,
        "usage_bytes": docs.store.usage_bytes(record.id),
        "file_counts": counts,
        "status": "in_progress" if counts["in_progress"] else "completed",
        "last_active_at": record.last_active_at,
        "metadata": record.metadata,
        "expires_after": None,
        "expires_at": None,
    }


def store_file_object(record: StoreFileRecord) -> dict[str, Any]:
    attributes = {k: v for k, v in record.attributes.items() if k != "_batch"}
    return {
        "id": record.file_id,
        "object": "vector_store.file",
        "created_at": record.created_at,
        "vector_store_id": record.store_id,
        "status": record.status,
        "last_error": record.last_error,
        "usage_bytes": record.usage_bytes,
        "chunking_strategy": record.chunking,
        "attributes": attributes,
    }


def _batch_object(docs: DocsService, store_id: str, batch_id: str) -> dict[str, Any]:
    """A file batch: the files it added, as they stand now."""
    files = [r for r in docs.store.store_files(store_id) if r.attributes.get("_batch") == batch_id]
    counts = {"in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0}
    for r in files:
        counts[r.status] += 1
    if not files:
        raise NotFound(f"No file batch {batch_id!r} in vector store {store_id!r}", param="batch_id")
    return {
        "id": batch_id,
        "object": "vector_store.files_batch",
        "created_at": min(r.created_at for r in files),
        "vector_store_id": store_id,
        "status": "in_progress" if counts["in_progress"] else "completed",
        "file_counts": {**counts, "total": len(files)},
    }


def install_vector_store_routes(app: FastAPI) -> None:
    @app.post("/v1/vector_stores")
    def create_store(body: CreateStore, docs: Docs, who: Who) -> dict[str, Any]:
        chunking = chunking_of(body.chunking_strategy)
        record = docs.create_store(
            who.tenant, body.name, body.file_ids, chunking, dict(body.metadata or {})
        )
        return store_object(docs, record)

    @app.get("/v1/vector_stores")
    def list_stores(
        docs: Docs,
        who: Who,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        items = [store_object(docs, s) for s in docs.store.stores(who.scope)]
        if order == "asc":
            items.reverse()
        return page(items, limit, after)

    @app.get("/v1/vector_stores/{store_id}")
    def get_store(store_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        return store_object(docs, docs.vector_store(who.scope, store_id))

    @app.post("/v1/vector_stores/{store_id}")
    def modify_store(store_id: str, body: ModifyStore, docs: Docs, who: Who) -> dict[str, Any]:
        record = docs.vector_store(who.scope, store_id)
        metadata = record.metadata if body.metadata is None else dict(body.metadata)
        docs.store.rename_store(store_id, body.name if body.name is not None else record.name,
                                metadata)  # fmt: skip
        return store_object(docs, docs.vector_store(who.scope, store_id))

    @app.delete("/v1/vector_stores/{store_id}")
    def delete_store(store_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        docs.delete_store(who.scope, store_id)
        return {"id": store_id, "object": "vector_store.deleted", "deleted": True}

    @app.post("/v1/vector_stores/{store_id}/files")
    def add_file(store_id: str, body: AddStoreFile, docs: Docs, who: Who) -> dict[str, Any]:
        chunking = chunking_of(body.chunking_strategy) if body.chunking_strategy else None
        record = docs.add_store_file(
            who.scope, store_id, body.file_id, chunking, dict(body.attributes or {})
        )
        return store_file_object(record)

    @app.get("/v1/vector_stores/{store_id}/files")
    def list_store_files(
        store_id: str,
        docs: Docs,
        who: Who,
        filter: Literal["in_progress", "completed", "failed", "cancelled"] | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        docs.vector_store(who.scope, store_id)
        items = [store_file_object(r) for r in docs.store.store_files(store_id, filter)]
        if order == "asc":
            items.reverse()
        return page(items, limit, after)

    @app.get("/v1/vector_stores/{store_id}/files/{file_id}")
    def get_store_file(store_id: str, file_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        return store_file_object(docs.store_file(who.scope, store_id, file_id))

    @app.delete("/v1/vector_stores/{store_id}/files/{file_id}")
    def remove_store_file(store_id: str, file_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        docs.remove_store_file(who.scope, store_id, file_id)
        return {"id": file_id, "object": "vector_store.file.deleted", "deleted": True}

    @app.post("/v1/vector_stores/{store_id}/file_batches")
    def add_batch(store_id: str, body: AddFileBatch, docs: Docs, who: Who) -> dict[str, Any]:
        store = docs.vector_store(who.scope, store_id)
        for file_id in body.file_ids:  # all of them exist for the caller and fit, or none
            docs.file(store.tenant, file_id)  # is added
            docs.check_room(store, file_id)
        chunking = chunking_of(body.chunking_strategy) if body.chunking_strategy else None
        batch_id = new_id("vsfb_")
        for file_id in body.file_ids:
            attributes = {**(body.attributes or {}), "_batch": batch_id}
            docs.add_store_file(who.scope, store_id, file_id, chunking, attributes)
        return _batch_object(docs, store_id, batch_id)

    @app.get("/v1/vector_stores/{store_id}/file_batches/{batch_id}")
    def get_batch(store_id: str, batch_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        docs.vector_store(who.scope, store_id)
        return _batch_object(docs, store_id, batch_id)

    @app.post("/v1/vector_stores/{store_id}/search")
    async def search(
        store_id: str, body: Search, docs: Docs, who: Who, request: Request
    ) -> dict[str, Any]:
        if who.rate_tenant is not None:  # a search is a request: the tenant's rate holds
            charge(request.app.state.kvgate.governance, who.rate_tenant)
        if body.filters is not None:
            attribute_filters.check(body.filters)
        queries = [body.query] if isinstance(body.query, str) else body.query
        if not queries or not all(q.strip() for q in queries):
            raise InvalidRequest("query must not be empty", param="query")
        if body.rewrite_query:
            queries = [rewrite(q) for q in queries]
        if len(" ".join(queries)) > 8192:
            raise InvalidRequest("query is longer than 8192 characters", param="query")
        results = await run_in_threadpool(
            docs.search, who.scope, [store_id], " ".join(queries), body.max_num_results,
            body.filters, body.retriever,
        )  # fmt: skip
        threshold = body.ranking_options.score_threshold if body.ranking_options else None
        data = [r.as_api() for r in results if threshold is None or r.score >= threshold]
        for item in data:
            item["attributes"].pop("_batch", None)
        return {
            "object": "vector_store.search_results.page",
            "search_query": queries,
            "data": data,
            "has_more": False,
            "next_page": None,
        }
