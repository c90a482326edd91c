"""What a generation request must pass before any work is spent on it, and the worker that
does the expensive part (templating, tokenizing) off the event loop.

Checked in order, each refusal counted for the tenant under its code: the tenant's request
rate (one request per choice, charged here, so refused requests count too), then the sizes
of the body's parts against ``RequestLimits``: messages, prompt characters (a prompt longer
than the context could ever hold, at the tokenizer's longest token, is refused without
tokenizing it), stop strings and stop token ids.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvgate.errors import KVGateError, PromptTooLong, RequestTooLarge
from kvgate.governance.tenants import TenantSpec
from kvgate.server.errors import AuthenticationFailed
from kvgate.server.governance import Governance
from kvgate.server.limits import RequestLimits
from kvgate.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvgate.tokenizer import Tokenizer

T = TypeVar("T")

#: Templating and tokenizing run here, never on the event loop: a 4 MB prompt took 4.4 s
#: there and /health waited as long. Two workers: the engine needs the other core.
_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-tokenize")


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args))


def prompt_chars(body: ChatCompletionRequest | CompletionRequest | TokenizeRequest) -> int:
    """Characters of the prompt's text (token ids count one each)."""
    messages = getattr(body, "messages", None)
    if messages is not None:
        total = 0
        for m in messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content is not None:
                total += sum(len(getattr(part, "text", "")) for part in m.content)
        return total
    prompt = getattr(body, "prompt", None)
    if prompt is None:
        return 0
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)


class Door:
    """The checks above, for one server: its limits, governance and tokenizer."""

    def __init__(
        self, limits: RequestLimits, governance: Governance, tokenizer: Tokenizer, context: int
    ) -> None:
        self.limits = limits
        self.governance = governance
        self.context = context
        #: Most characters one token stands for: a prompt of c characters has at least
        #: c / token_chars tokens. Twice that, for normalizers that shrink text.
        self.token_chars = 2 * tokenizer.max_token_chars

    def max_prompt_chars(self, spec: TenantSpec | None) -> tuple[int, bool]:
        """(limit, whether it comes from the context rather than the configured cap)."""
        tokens = self.context
        if spec is not None and spec.max_context is not None:
            tokens = min(tokens, spec.max_context)
        bound = tokens * self.token_chars
        cap = self.limits.max_prompt_chars
        return (cap, False) if cap is not None and cap < bound else (bound, True)

    def check_sizes(
        self,
        body: ChatCompletionRequest | CompletionRequest | TokenizeRequest,
        spec: TenantSpec | None,
    ) -> None:
        lim = self.limits
        messages = getattr(body, "messages", None)
        if messages is not None and len(messages) > lim.max_messages:
            raise RequestTooLarge(
                f"{len(messages)} messages; at most {lim.max_messages} per request",
                param="messages",
            )
        chars = prompt_chars(body)
        limit, from_context = self.max_prompt_chars(spec)
        if chars > limit:
            param = "messages" if messages is not None else "prompt"
            if from_context:
                raise PromptTooLong(chars // self.token_chars, 0, limit // self.token_chars)
            raise RequestTooLarge(
                f"the prompt has {chars} characters; at most {limit} per request", param=param
            )
        if isinstance(body, TokenizeRequest):
            return
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > lim.max_stop:
            raise RequestTooLarge(f"{len(stop)} stop strings; at most {lim.max_stop}", param="stop")
        if any(len(s) > lim.max_stop_chars for s in stop):
            raise RequestTooLarge(
                f"a stop string is longer than {lim.max_stop_chars} characters", param="stop"
            )
        ids = body.stop_token_ids or []
        if len(ids) > lim.max_stop_token_ids:
            raise RequestTooLarge(
                f"{len(ids)} stop_token_ids; at most {lim.max_stop_token_ids}",
                param="stop_token_ids",
            )

    def enter(
        self,
        tenant: str,
        body: ChatCompletionRequest | CompletionRequest,
        charged: bool = False,
    ) -> None:
        """Charge the tenant's request rate (unless ``charged`` already, by ``charge``),
        then check the body's sizes; raises the refusal, counted for the tenant."""
        if not charged:
            charge(self.governance, tenant, (body.n or 1) * _num_prompts(body))
        spec = self.governance.tenants.spec(tenant)
        try:
            self.check_sizes(body, spec)
        except KVGateError as exc:
            self.governance.count_refusal(tenant, exc.code)
            raise


def charge(governance: Governance, tenant: str, n: int = 1) -> None:
    """Take ``n`` requests from the tenant's requests per minute (over every model of the
    server, and for work that is no generation: a document search), before any work is
    done; raises the refusal, counted for the tenant."""
    tenants = governance.tenants
    if not tenants.open and tenant not in tenants.tenants:
        # The key was valid when checked, and a reload removed its tenant since: the
        # request must not run on default settings.
        raise AuthenticationFailed(f"tenant {tenant!r} no longer exists: its key is revoked")
    try:
        governance.rates.charge_requests(tenants.spec(tenant), n)
    except KVGateError as exc:
        governance.count_refusal(tenant, exc.code)
        raise


def _num_prompts(body: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(body, ChatCompletionRequest):
        return 1
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1
