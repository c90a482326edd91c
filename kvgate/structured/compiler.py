"""Grammars compiled once per tokenizer, cached by their text; a fresh matcher per request.

llguidance compiles a grammar when an ``LLMatcher`` is built (1-6 ms for the test schemas on
SmolLM2's 49,152-token vocabulary, AMD EPYC; bench/grammar_libs.py). The cache keeps one
compiled matcher per grammar text and hands out ``deep_copy()``s of it (microseconds), so a
schema sent again compiles only once. ``check`` runs at the server's door, off the event loop,
before a request is admitted: a grammar that does not compile is a 400 naming its field.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance

from kvgate.errors import InvalidRequest
from kvgate.structured.spec import Grammar
from kvgate.tokenizer import Tokenizer

#: Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: Sequence[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        """``eos_token_ids``: what may end a complete output (the engine's end tokens)."""
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it: built at first use (~0.6 s for SmolLM2's),
        so engines that never constrain a request never pay for it."""
        with self._lock:
            if self._lltokenizer is None:
                try:
                    self._lltokenizer = llguidance.LLTokenizer(
                        self.tokenizer.backend.to_str(),
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids or None,
                    )
                except Exception as exc:  # a vocabulary llguidance cannot read
                    raise InvalidRequest(
                        f"constrained output is not available for this model's tokenizer: {exc}",
                        param="response_format",
                    ) from exc
            return self._lltokenizer

    def _compiled(self, grammar: Grammar) -> llguidance.LLMatcher:
        with self._lock:
            found = self._cache.get(grammar.text)
            if found is not None:
                self._cache.move_to_end(grammar.text)
                self.hits += 1
                return found
        # Compile outside the lock (llguidance releases the GIL while it compiles).
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar.text, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"the {grammar.kind.replace('_', ' ')} does not compile: "
                f"{_first_lines(matcher.get_error())}",
                param=grammar.param,
            )
        # Bytes every output must start with that no run of tokens spells (SmolLM2's
        # vocabulary has no 0xF1, so a choice of "\U00040000" cannot be written): llguidance's
        # mask then offers a token that its own parser refuses, a failure mid-decode.
        forced = matcher.compute_ff_bytes()
        if (
            forced
            and self.lltokenizer.decode_bytes(self.lltokenizer.tokenize_bytes(forced)) != forced
        ):
            raise InvalidRequest(
                f"the {grammar.kind.replace('_', ' ')} requires bytes ({forced[:16]!r}) that this "
                "model's vocabulary cannot produce",
                param=grammar.param,
            )
        # No forced bytes, yet no token can start it (choices of U+40000 and U+80000: F1 or F2
        # first, and SmolLM2 has neither byte): the first mask is where llguidance finds out.
        probe = matcher.deep_copy()
        probe.compute_logit_bias()
        if probe.is_error():
            raise InvalidRequest(
                f"the {grammar.kind.replace('_', ' ')} cannot be started by any token of this "
                "model's vocabulary: its output cannot be produced",
                param=grammar.param,
            )
        with self._lock:
            self.misses += 1
            self._cache[grammar.text] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def check(self, grammar: Grammar) -> None:
        """Raise ``InvalidRequest`` (naming ``grammar.param``) unless it compiles."""
        self._compiled(grammar)

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, the request's own."""
        return self._compiled(grammar).deep_copy()


def _first_lines(message: str, limit: int = 400) -> str:
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    return text[:limit]
