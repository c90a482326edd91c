"""Domain exceptions. The HTTP layer maps these to the OpenAI error shape in one place.

Every error names the parameter or file it is about, so a caller can act on it without a traceback.
"""

from __future__ import annotations


class KVGateError(Exception):
    """Base class of every error kvgate raises on purpose."""

    #: OpenAI-style machine-readable code (``invalid_request_error`` family unless overridden).
    code: str = "kvgate_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:
        # Whatever a subclass's __init__ takes: its state travels whole (errors cross from
        # the engine's process to the front end's).
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[KVGateError], args: tuple[object, ...], state: dict[str, object]) -> object:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidRequest(KVGateError):
    """A request parameter has a value the engine cannot honour (400)."""

    code = "invalid_request_error"


#: How a request's error message starts when its grammar reached a dead end mid-decode.
GRAMMAR_FAILED = "constrained decoding failed: "


class ConstraintUnsatisfiable(InvalidRequest):
    """The constrained output reached a point that no token of the model's vocabulary can
    continue (a choice or pattern needing bytes it cannot spell, past the start the grammar
    compiler checks): the request asked for what this model cannot write (400), found
    mid-decode."""

    code = "constraint_unsatisfiable"


class InvalidSamplingParams(InvalidRequest):
    """A sampling parameter is out of range; ``param`` names it."""

    code = "invalid_value"


class EmptyPrompt(InvalidRequest):
    code = "empty_prompt"

    def __init__(self) -> None:
        super().__init__("prompt must contain at least one token", param="prompt")


class PromptTooLong(InvalidRequest):
    """Prompt (plus the tokens asked for) does not fit the model's context window."""

    code = "context_length_exceeded"

    def __init__(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        *,
        at_least: bool = False,
        param: str = "prompt",
        tenant: str | None = None,
    ) -> None:
        """``at_least``: ``num_prompt_tokens`` is a lower bound (the prompt was refused
        before it was tokenized), not its count. ``tenant``: the limit is that tenant's
        ``max_context``, not the model's, and the message says so."""
        has = f"at least {num_prompt_tokens}" if at_least else f"{num_prompt_tokens}"
        asked = f" and {max_tokens} more were requested" if max_tokens or not at_least else ""
        whose = "This model's" if tenant is None else f"Tenant {tenant!r}'s"
        super().__init__(
            f"{whose} maximum context length is {max_model_len} tokens; the prompt has "
            f"{has} tokens{asked}",
            param=param,
        )
        self.tenant = tenant
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class RequestTooLarge(InvalidRequest):
    """A part of the request is over one of the server's limits (prompt characters, messages,
    stop strings); refused before any work is spent on it. ``param`` names the field."""

    code = "request_too_large"


class TenantLimitExceeded(InvalidRequest):
    """The request can never fit one of its tenant's limits; ``param`` names the limit."""

    code = "tenant_limit_exceeded"

    def __init__(self, message: str, *, limit: str, value: int | float) -> None:
        super().__init__(message, param=limit)
        self.limit = limit
        self.value = value


class QueueTimeout(KVGateError):
    """The request waited past its tenant's max_queue_time and was refused."""

    code = "queue_timeout"


class PermissionDenied(KVGateError):
    """The caller's key may not do this (e.g. an admin endpoint with a tenant key)."""

    code = "permission_denied"


class DuplicateRequestId(InvalidRequest):
    code = "duplicate_request_id"

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use", param="request_id")


class ModelLoadError(KVGateError):
    """The model could not be loaded; the message names the file and what is wrong with it."""

    code = "model_load_error"

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, param="model")
        self.path = path


class ModelNotFound(ModelLoadError):
    code = "model_not_found"


class CorruptWeights(ModelLoadError):
    code = "corrupt_weights"


class UnsupportedModel(ModelLoadError):
    code = "unsupported_model"


class InvalidConfig(KVGateError):
    """An engine setting is invalid; ``param`` names the setting."""

    code = "invalid_config"


class KVCacheTooSmall(InvalidConfig):
    code = "kv_cache_too_small"


class EngineDead(KVGateError):
    """The engine loop stopped after an unrecoverable error; requests cannot be served."""

    code = "engine_dead"


class Overloaded(KVGateError):
    """The request queue is full; the client should retry after ``retry_after`` seconds."""

    code = "server_is_overloaded"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(KVGateError):
    """One request failed inside the engine; the engine goes on serving the others."""

    code = "request_failed"
