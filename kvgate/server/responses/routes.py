"""The routes of ``/v1/responses``: create, retrieve, delete, cancel, list input items.
Every stored response belongs to the caller that made it (``files.Caller``: its tenant, or
its key): another caller's is a 404; an admin key sees and deletes every one."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response

from kvgate.errors import InvalidRequest
from kvgate.retrieval.service import NotFound
from kvgate.server.files import Who
from kvgate.server.responses.create import Where, create_response
from kvgate.server.responses.protocol import ResponsesRequest
from kvgate.server.responses.stored import ResponseStore, StoredResponse
from kvgate.server.routing import Route
from kvgate.server.streaming import ClientDisconnected


def _store(request: Request) -> ResponseStore:
    store: ResponseStore | None = request.app.state.kvgate.responses
    if store is None:  # pragma: no cover - the server always opens one
        raise InvalidRequest("this server stores no responses", param="response_id")
    return store


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"No response found with id '{response_id}'.", param="response_id")


async def _owned(request: Request, who: Any, response_id: str) -> StoredResponse:
    row = await run_in_threadpool(_store(request).get, response_id, who.scope)
    if row is None:
        raise _not_found(response_id)
    return row


def install_response_routes(app: FastAPI) -> None:
    @app.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, request: Request, route: Route, who: Who) -> Any:
        state = request.app.state.kvgate
        where = Where(route(body.model), state.docs, state.responses, state.background, who)
        try:
            return await create_response(where, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.get("/v1/responses/{response_id}")
    async def get_response(
        response_id: str, request: Request, who: Who, stream: bool = False
    ) -> dict[str, Any]:
        if stream:
            raise InvalidRequest(
                "a stored response is retrieved whole; stream it when you create it",
                param="stream",
            )
        return (await _owned(request, who, response_id)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request, who: Who) -> dict[str, Any]:
        row = await _owned(request, who, response_id)
        runs = request.app.state.kvgate.background
        if runs.cancel(row.id):
            await runs.wait(row.id)
        if not await run_in_threadpool(_store(request).delete, row.id, who.scope):
            raise _not_found(response_id)
        return {"id": row.id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request, who: Who) -> dict[str, Any]:
        row = await _owned(request, who, response_id)
        if not row.response.get("background"):
            raise InvalidRequest("only a background response can be cancelled", param="response_id")
        store, runs = _store(request), request.app.state.kvgate.background
        if row.status in ("queued", "in_progress"):
            await run_in_threadpool(store.cancel, row.id)  # seen by the process running it
            if runs.cancel(row.id):
                await runs.wait(row.id)
        return (await _owned(request, who, response_id)).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        who: Who,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        items = list((await _owned(request, who, response_id)).input)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise InvalidRequest(f"no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
