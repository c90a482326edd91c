"""Validating and tokenizing a request before it reaches the engine loop: on whichever side
of the engine the caller is (the engine's own process, or the HTTP front end's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.engine.request import Request
from kvgate.errors import EmptyPrompt, InvalidRequest, PromptTooLong
from kvgate.sampling_params import SamplingParams
from kvgate.structured.compiler import GrammarCompiler
from kvgate.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestFactory:
    """``matchers``: give each constrained request its grammar's matcher now (False: the
    engine's process makes it on arrival; a matcher does not cross processes);
    ``speculative``: the engine drafts tokens (a request may then ask for it)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    grammars: GrammarCompiler
    eos_token_ids: frozenset[int]
    matchers: bool = True
    speculative: bool = False

    def make(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: bytes | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        queue_deadline: float | None = None,
    ) -> Request:
        """Validate and tokenize a request. Thread-safe: touches no engine state.

        ``deadline`` / ``queue_deadline`` are ``time.monotonic()`` instants (see ``Request``).
        """
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                    param="prompt",
                )
        if not token_ids:
            raise EmptyPrompt()
        if params.speculative and not self.speculative:
            raise InvalidRequest(
                "speculative: this server does not speculate (start it with --speculative "
                "ngram), so the request cannot ask for it",
                param="speculative",
            )
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLong(len(token_ids), params.max_tokens, self.max_model_len)
        # A 400 naming the field if it does not compile; cached once compiled (the server
        # compiled it at its door), so the engine thread never compiles.
        grammar = params.grammar
        if grammar is not None and not self.matchers:
            self.grammars.check(grammar)
        matcher = self.grammars.matcher(grammar) if grammar is not None and self.matchers else None
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            tenant=tenant,
            deadline=deadline,
            queue_deadline=queue_deadline,
        )
        request.matcher = matcher
        return request
