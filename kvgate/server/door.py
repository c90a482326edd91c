"""What a generation request must pass before any work is spent on it, and the worker that
does the expensive part (templating, tokenizing) off the event loop.

Checked in order, each refusal counted for the tenant under its code: the tenant's request
rate (one request per choice, charged here, so refused requests count too), then the sizes
of the body's parts against ``RequestLimits``: messages, prompt characters (summed over a
list of prompts), then each prompt against the context at the fewest tokens its text can be
(``token_floor.py``: for any script, without tokenizing it), stop strings and stop token ids.
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
from kvgate.token_floor import SLACK
from kvgate.tokenizer import Tokenizer

T = TypeVar("T")

#: Templating and tokenizing run here, never on the event loop: a 4 MB prompt took 4.4 s
#: there and /health waited as long. Two workers: the engine needs the other core.
_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-tokenize")


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args))


Prompt = tuple[list[str], int]  # one prompt: its texts, and its count of token ids


def prompts_of(body: ChatCompletionRequest | CompletionRequest | TokenizeRequest) -> list[Prompt]:
    """Each prompt of the body (a chat's messages are one; a completion's list is one each)."""
    messages = getattr(body, "messages", None)
    if messages is not None:
        texts: list[str] = []
        for m in messages:
            if isinstance(m.content, str):
                texts.append(m.content)
            elif m.content is not None:
                texts.extend(getattr(part, "text", "") for part in m.content)
        return [(texts, 0)]
    prompt = getattr(body, "prompt", None)
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [([prompt], 0)]
    if all(isinstance(p, int) for p in prompt):
        return [([], len(prompt))]
    return [([p], 0) if isinstance(p, str) else ([], len(p)) for p in prompt]


def prompt_chars(body: ChatCompletionRequest | CompletionRequest | TokenizeRequest) -> int:
    """Characters of the prompt's text (token ids count one each), over every prompt."""
    return sum(sum(len(t) for t in texts) + ids for texts, ids in prompts_of(body))


class Door:
    """The checks above, for one server: its limits, governance and tokenizer."""

    def __init__(
        self, limits: RequestLimits, governance: Governance, tokenizer: Tokenizer, context: int
    ) -> None:
        self.limits = limits
        self.governance = governance
        self.context = context
        self.floor = tokenizer.token_floor

    def context_for(self, spec: TenantSpec | None) -> int:
        """The most prompt tokens a request of the tenant of ``spec`` can have."""
        if spec is not None and spec.max_context is not None:
            return min(self.context, spec.max_context)
        return self.context

    def check_prompts(self, prompts: list[Prompt], spec: TenantSpec | None, param: str) -> None:
        """Refuse, before any tokenizing, prompts over the configured characters (summed) or
        one that cannot fit the context: at least ``TokenFloor`` tokens, which holds for any
        script (``token_floor.py``). Work is bounded by what passes: the texts of a prompt
        that fits are at most ``SLACK`` x the context x its longest tokens."""
        cap = self.limits.max_prompt_chars
        if cap is not None:
            chars = sum(sum(len(t) for t in texts) + ids for texts, ids in prompts)
            if chars > cap:
                raise RequestTooLarge(
                    f"the prompt has {chars} characters; at most {cap} per request", param=param
                )
        tokens = self.context_for(spec)
        tenant = spec.name if spec is not None and tokens < self.context else None
        for texts, ids in prompts:
            if ids + sum(len(t) for t in texts) / SLACK <= tokens:
                continue  # a character weighs at most 1: too short to be over, not weighed
            floor = ids + self.floor.tokens(texts, stop_above=tokens - ids)
            if floor > tokens:
                raise PromptTooLong(floor, 0, tokens, at_least=True, param=param, tenant=tenant)

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
        self.check_prompts(prompts_of(body), spec, "messages" if messages is not None else "prompt")
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
            charge(self.governance, tenant, (body.n or 1) * num_prompts(body))
        self.counted(tenant, self.check_sizes, body, self.governance.tenants.spec(tenant))

    def counted(self, tenant: str, check: Callable[..., None], *args: object) -> None:
        """Run ``check``; a refusal it raises is counted for the tenant, then raised."""
        try:
            check(*args)
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


def num_prompts(body: ChatCompletionRequest | CompletionRequest) -> int:
    """Prompts of the body: a chat's is one, a completion's list of prompts is one each."""
    if isinstance(body, ChatCompletionRequest):
        return 1
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1
