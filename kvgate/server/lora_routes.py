"""Loading and unloading LoRA adapters while serving, with vLLM's endpoints (admin keys
only, as the ``/admin`` endpoints: 403 for any other key, and on a server without a
tenants file, which has no admin key).

POST /v1/load_lora_adapter ``{"lora_name", "lora_path", "model"?}``: the adapter is read and
checked against the base model (``model``: its served name; default the first model) and
then served under ``lora_name``: a request selects it by ``"model": lora_name``. 400 for a
directory that is not there or an adapter that does not fit the model (the message names
the tensor and the shapes), for a name in use, or for a model class without LoRA.
POST /v1/unload_lora_adapter ``{"lora_name"}``: new requests naming it get 404; those
running finish on it. 404 for a name no model has.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from kvgate.engine.lora_cache import LoraExists, LoraNotFound
from kvgate.server.admin import require_admin


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1)]
    #: The served base model to load it into (None: the first).
    model: str | None = None


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


def install_lora_routes(app: FastAPI) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoraBody, request: Request) -> dict[str, Any]:
        state = require_admin(request)
        models = state.models
        name = body.lora_name
        if name in models.slots or models.adapter(name) is not None:
            raise LoraExists(f"a model or LoRA adapter named {name!r} is already served",
                             param="lora_name")  # fmt: skip
        slot = models.default if body.model is None else models.slots.get(body.model)
        if slot is None:
            raise LoraNotFound(f"no base model named {body.model!r} is served", param="model")
        ctx = slot.check()
        await asyncio.wrap_future(ctx.engine.lora(name, body.lora_path))
        ctx.loras[name] = body.lora_path
        return {"status": "loaded", "lora_name": name, "parent": ctx.served_model_name}

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoraBody, request: Request) -> dict[str, Any]:
        state = require_admin(request)
        slot = state.models.adapter(body.lora_name)
        if slot is None:
            raise LoraNotFound(
                f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name"
            )
        ctx = slot.check()
        path = ctx.loras.pop(body.lora_name)  # new requests naming it: 404 from now on
        try:
            await asyncio.wrap_future(ctx.engine.lora(body.lora_name, None))
        except BaseException:
            ctx.loras[body.lora_name] = path
            raise
        return {"status": "unloaded", "lora_name": body.lora_name}
