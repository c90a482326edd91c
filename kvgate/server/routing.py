"""Who calls, and which served model a request goes to (the FastAPI dependencies)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from kvgate.errors import KVGateError
from kvgate.server.access_log import AccessRecord, access_record
from kvgate.server.embedding_model import ALIASES, NotAChatModel
from kvgate.server.errors import AuthenticationFailed, ModelNotServed
from kvgate.server.serving import ServingContext

if TYPE_CHECKING:
    from kvgate.server.app import ServerState


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvgate
    return state


def authenticate(request: Request) -> str:
    """The caller's tenant, from its API key (``default`` when the server is open)."""
    given = request.headers.get("authorization")
    tenant = _state(request).governance.tenants.tenant_of(given)
    if tenant is None:
        raise AuthenticationFailed(
            "Incorrect API key provided"
            if given
            else "Missing API key: send 'Authorization: Bearer YOUR_KEY'"
        )
    access_record(request).tenant = tenant
    return tenant


class Router:
    """Routes one authenticated caller's request to the model its body names."""

    def __init__(self, state: ServerState, tenant: str, record: AccessRecord | None = None) -> None:
        self.state = state
        self.tenant = tenant
        self.record = record

    def __call__(self, model: str | None) -> ServingContext:
        """The model's serving context (see ``ServedModels.route``); a 403, 404 or 503
        counts as the tenant's refusal."""
        governance = self.state.governance
        spec = governance.spec(self.tenant)
        try:
            ctx = self.state.models.route(model, spec)
        except KVGateError as exc:
            governance.count_refusal(self.tenant, exc.code)
            if isinstance(exc, ModelNotServed) and self._is_embedding(model):
                assert model is not None
                models = self.state.models
                served = [s.name for s in models.allowed(spec)] or models.names
                raise NotAChatModel(model, served) from None
            raise
        if self.record is not None:
            self.record.model_version = ctx.model_version
        return ctx

    def _is_embedding(self, model: str | None) -> bool:
        return model is not None and self.state.embedding is not None and model in ALIASES


def router(request: Request, tenant: Annotated[str, Depends(authenticate)]) -> Router:
    return Router(_state(request), tenant, access_record(request))


Route = Annotated[Router, Depends(router)]
