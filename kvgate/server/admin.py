"""Admin endpoints, for the admin keys of the tenants file only.

GET /admin/usage?tenant=&since=&until=: the usage ledger's records (settled, and reconciled
after a crash) admitted in [since, until) (Unix seconds), and their totals.
GET /admin/tenants: per-tenant accounting (tokens, KV block-seconds, blocks held against
quota, running / waiting, refusals by reason). POST /admin/reload: re-read the tenants file;
an invalid file is refused with its error and the old one stays in force.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from kvgate.errors import PermissionDenied


def require_admin(request: Request) -> Any:
    state = request.app.state.kvgate
    if not state.governance.tenants.is_admin(request.headers.get("authorization")):
        raise PermissionDenied("this endpoint needs an admin key (admin_keys in the tenants file)")
    return state


def install_admin_routes(app: FastAPI) -> None:
    @app.get("/admin/tenants")
    def tenants(request: Request) -> dict[str, Any]:
        state = require_admin(request)
        return {"tenants": state.governance.report(state.snapshots())}

    @app.get("/admin/usage")
    def usage(
        request: Request,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> dict[str, Any]:
        state = require_admin(request)
        result: dict[str, Any] = state.usage.query(tenant, since, until)
        return result

    @app.post("/admin/reload")
    def reload(request: Request) -> dict[str, Any]:
        state = require_admin(request)
        new = state.governance.reload()
        return {"status": "reloaded", "source": new.source, "tenants": sorted(new.tenants)}
