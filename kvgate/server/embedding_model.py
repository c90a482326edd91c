"""The embedding model a server lists and serves on ``/v1/embeddings``: multilingual-e5-small,
the document store's own embedder (``retrieval/retrieval.py``, ``DocsService.embedder``), on
a server that has the ``retrieval`` extra.

It is a model like the chat models as far as callers see: listed by ``/v1/models`` (after
them) and ``/v1/models/{id}``, with a lineage version over its weights and precision, and a
tenant limited to some models (``models = [...]``) may call it only when its name is there.
A request may name it by its Hugging Face id as well, as vLLM and TEI list it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

import kvgate
from kvgate.engine.lineage import ModelVersion, weights_digest
from kvgate.errors import KVGateError
from kvgate.governance.tenants import TenantSpec
from kvgate.retrieval.e5_encoder import batches
from kvgate.retrieval.retrieval import E5Embedder
from kvgate.retrieval.service import DocsService
from kvgate.server.errors import ModelNotAllowed, ModelNotServed

NAME = "multilingual-e5-small"
#: The names a request may call it by.
ALIASES = frozenset({NAME, "intfloat/multilingual-e5-small"})
#: Tokens one input may hold, ``<s>`` and ``</s>`` included (the model's positions).
MAX_TOKENS = 512
DIMENSIONS = 384
#: Tokens per encoder pass (the encoder's own batch, ``e5_encoder.BATCH_TOKENS``).
PASS_TOKENS = 4096

#: One encoder pass at a time in the server: each spreads over every core, so requests
#: embedding at once take turns pass by pass instead of thrashing the cores together.
_ENCODER = threading.Lock()


class NotAnEmbeddingModel(ModelNotServed):
    """A served chat model named on ``/v1/embeddings`` (404, OpenAI's ``model_not_found``)."""

    def __init__(self, model: str) -> None:
        KVGateError.__init__(
            self,
            f"The model {model!r} is a chat model, not an embedding model; /v1/embeddings "
            f"serves {NAME!r}",
            param="model",
        )


class NotAChatModel(ModelNotServed):
    """The embedding model named on a route that generates (404 ``model_not_found``)."""

    def __init__(self, model: str, served: Sequence[str]) -> None:
        names = ", ".join(repr(n) for n in served)
        KVGateError.__init__(
            self,
            f"The model {model!r} is an embedding model (POST /v1/embeddings); this route is "
            f"served by {names}",
            param="model",
        )


class EmbeddingModel:
    """The served embedder: its name, card and version; the encoder is ``docs.embedder``
    (loaded on first use, on a worker thread)."""

    def __init__(self, docs: DocsService, precision: str) -> None:
        self.docs = docs
        self._precision = precision  # as configured: auto, float32 or bfloat16
        self._version: ModelVersion | None = None
        self._lock = threading.Lock()

    @staticmethod
    def named(model: str | None) -> bool:
        """Whether a request naming ``model`` (None: none) means this model."""
        return model is None or model in ALIASES

    def check(self, model: str | None, spec: TenantSpec, chat_models: Sequence[str]) -> None:
        """Raise 404 for a name that is not this model (a chat model's says so), 403 when the
        tenant may not use it."""
        if not self.named(model):
            assert model is not None
            if model in chat_models:
                raise NotAnEmbeddingModel(model)
            raise ModelNotServed(model, NAME)
        if not spec.allows(NAME):
            raise ModelNotAllowed(NAME, spec.name, spec.models or ())

    def version(self) -> ModelVersion:
        """The lineage version: the weights' sha256 (from the digest cache once computed)
        and the precision the linears run in. Reads the weights the first time: call it on
        a worker thread."""
        with self._lock:
            if self._version is None:
                self._version = _version(self._resolved_precision())
            return self._version

    def _resolved_precision(self) -> str:
        if self._precision != "auto":
            return self._precision
        from kvgate.retrieval.e5_encoder import auto_precision

        return auto_precision()[0]

    def encoder(self) -> E5Embedder:
        """The store's embedder (loads it the first time: call it on a worker thread)."""
        embedder = self.docs.embedder
        if not isinstance(embedder, E5Embedder):
            raise TypeError(f"/v1/embeddings needs the e5 embedder, not {type(embedder).__name__}")
        return embedder

    def tokens(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, without ``<s>`` and ``</s>`` (worker thread)."""
        return self.encoder().tokens(texts)

    def vectors(self, content: Sequence[Sequence[int]]) -> np.ndarray:
        """[n, 384] float32, L2-normalised (worker thread): inputs of like lengths together,
        in passes of up to ``PASS_TOKENS`` tokens (64 sentences are one or two passes); a
        vector does not depend on its batch beyond float rounding."""
        encoder = self.encoder()
        order = sorted(range(len(content)), key=lambda i: len(content[i]))
        out = np.zeros((len(content), encoder.dim), dtype=np.float32)
        for run in batches([len(content[i]) + 2 for i in order], PASS_TOKENS):
            picked = [order[k] for k in run]
            with _ENCODER:
                out[picked] = encoder.vectors([content[i] for i in picked])
        return out

    def card(self, *, paths: bool) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it (as ``openai_routes.model_card`` does a chat
        model's); computes its version the first time (on a worker thread)."""
        version = self.version()
        source = version.source if paths else PurePath(version.source).name
        return {
            "id": NAME,
            "object": "model",
            "created": version.created,
            "owned_by": "kvgate",
            "max_model_len": MAX_TOKENS,
            "version": version.id,
            "source": source,
            "weights_sha256": version.weights_sha256,
        }


def _version(precision: str) -> ModelVersion:
    from kvgate.retrieval.e5_file import default_path

    source = default_path()
    weights, created = weights_digest(source)
    described = {"weights_sha256": weights, "precision": precision, "kvgate": kvgate.__version__}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return ModelVersion(f"{NAME}-{digest[:12]}", digest, weights, created, source)
