"""OpenAI's Files API: ``POST /v1/files`` (multipart ``file`` and ``purpose``), ``GET
/v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE
/v1/files/{id}``. A file belongs to the tenant whose key uploaded it; other tenants get 404;
an admin key sees and deletes every tenant's."""

from __future__ import annotations

import shutil
import tempfile
import unicodedata
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response

from kvgate.errors import InvalidRequest
from kvgate.governance.tenants import key_digest
from kvgate.retrieval.extra import missing_modules, unavailable
from kvgate.retrieval.service import DocsService, NotFound
from kvgate.server.access_log import access_record
from kvgate.server.errors import AuthenticationFailed

#: The purposes OpenAI accepts; kvgate reads every file the same way.
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")


@dataclass(frozen=True)
class Caller:
    """Who calls a documents endpoint. ``tenant`` is the owner of what it creates: its
    tenant, or for a key that names no tenant (``--api-keys-file`` lines with a key alone)
    or an admin key, that key itself (by its digest), so such keys never share documents.
    An admin sees every owner's."""

    tenant: str
    admin: bool = False
    #: The tenant whose request rate its searches are charged to (None: an admin key).
    rate_tenant: str | None = None

    @property
    def scope(self) -> str | None:
        """The tenant whose objects the caller sees; None: everyone's."""
        return None if self.admin else self.tenant


def docs_caller(request: Request) -> Caller:
    state = request.app.state.kvgate
    tenants = state.governance.tenants
    auth = request.headers.get("authorization")
    tenant = tenants.tenant_of(auth)
    admin = tenants.is_admin(auth)
    if tenant is None and not admin:
        raise AuthenticationFailed(
            "Incorrect API key provided"
            if auth
            else "Missing API key: send 'Authorization: Bearer YOUR_KEY'"
        )
    access_record(request).tenant = tenant
    key = (auth or "").partition(" ")[2].strip()
    if tenant is None or tenants.key_salt(auth) is not None:
        return Caller(f"key:{key_digest(key).hex()}", admin, tenant)
    return Caller(tenant, admin, tenant)


def docs_service(request: Request) -> DocsService:
    service: DocsService | None = request.app.state.kvgate.docs
    if service is None:
        raise unavailable(missing_modules())
    return service


Docs = Annotated[DocsService, Depends(docs_service)]
Who = Annotated[Caller, Depends(docs_caller)]


def page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor page over ``items`` (newest first): ``limit`` after id ``after``."""
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


#: Longest file name accepted (characters), as most file systems allow.
MAX_NAME_CHARS = 255


def install_file_routes(app: FastAPI) -> None:
    @app.post("/v1/files")
    async def upload(
        docs: Docs,
        who: Who,
        file: Annotated[UploadFile, File()],
        purpose: Annotated[str, Form()],
    ) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise InvalidRequest(
                f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose"
            )
        name = Path(file.filename or "").name
        if not name:
            raise InvalidRequest("the upload needs a file name", param="file")
        if len(name) > MAX_NAME_CHARS or any(unicodedata.category(c) == "Cc" for c in name):
            # Names reach logs, listings and citations: NUL, ESC or BEL there is an attack.
            raise InvalidRequest(
                f"the file name must be at most {MAX_NAME_CHARS} characters, with no control "
                "characters",
                param="file",
            )
        # The store's spool (0700); NamedTemporaryFile makes each upload 0600.
        with tempfile.NamedTemporaryFile(dir=docs.store.spool, delete=False) as out:
            await run_in_threadpool(shutil.copyfileobj, file.file, out)
            path = Path(out.name)
        if path.stat().st_size == 0:
            path.unlink()
            raise InvalidRequest(f"{name!r} is empty", param="file")
        record = await run_in_threadpool(docs.add_file, who.tenant, name, purpose, path)
        return record.as_api()

    @app.get("/v1/files")
    def list_files(
        docs: Docs,
        who: Who,
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
        order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        items = [f.as_api() for f in docs.store.files(who.scope, purpose)]
        if order == "asc":
            items.reverse()
        return page(items, limit, after)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        return docs.file(who.scope, file_id).as_api()

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, docs: Docs, who: Who) -> Response:
        record = docs.file(who.scope, file_id)
        local = docs.store.local_file(record.id)
        if local is not None:
            return FileResponse(
                local, media_type="application/octet-stream", filename=record.filename
            )
        try:
            data = docs.store.file_bytes(record.id)
        except FileNotFoundError:
            raise NotFound(f"No such file: {file_id!r}", param="file_id") from None
        quoted = urllib.parse.quote(record.filename)
        return Response(
            data,
            media_type="application/octet-stream",
            headers={"content-disposition": f"attachment; filename*=utf-8''{quoted}"},
        )

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, docs: Docs, who: Who) -> dict[str, Any]:
        docs.delete_file(who.scope, file_id)
        return {"id": file_id, "object": "file", "deleted": True}
