"""Prefix-cache affinity: which replica most likely holds a request's prompt prefix.

Pure and Ray-free (the Ray Serve router in ``cluster/router.py`` is an adapter over it).

A request's prompt is read as text, in the order the chat template lays it out (model, then
each message's role and content, or the completion prompt), and cut into blocks of
``BLOCK_CHARS`` characters. Each block's key is a hash chained over every block before it,
as the engine's prefix cache keys its KV blocks over tokens: two requests share a block key
only if they share all the text up to its end. Only whole blocks count, as in the engine.
Text, not tokens: the ingress needs no tokenizer, and equal text gives equal tokens
under one template.

``AffinityTable`` remembers which replicas each block key was sent to (bounded, least
recently used first out); ``rank`` orders the replicas for one request: the one holding
the longest prefix first, unless it is loaded past the least loaded by more than
``imbalance`` requests or its KV pool is nearly full, in which case load alone decides.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Characters per block: ~128 tokens of English, ~100-250 of Chinese text; a replica's
#: cached prefix is worth following from about one engine block (16 tokens) up, and a
#: 512-character block keeps the keys per request few (a 16k-character prompt: 32).
BLOCK_CHARS = 512
#: Blocks hashed per request at most: beyond 64k characters the prefix decides nothing more.
MAX_BLOCKS = 128


def prompt_text(path: str, body: Mapping[str, Any]) -> str:
    """The text a request's prompt starts with, as routing sees it ('' if it has none)."""
    model = body.get("model")
    head = f"{model}\x1d" if isinstance(model, str) else "\x1d"
    if path.endswith("/chat/completions") or path.endswith("/responses"):
        messages = body.get("messages", body.get("input"))
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            head += f"system\x1f{instructions}\x1e"
        if isinstance(messages, str):
            return head + messages
        if not isinstance(messages, list):
            return ""
        parts = [head]
        for m in messages:
            if isinstance(m, Mapping):
                parts.append(f"{m.get('role', '')}\x1f{_content(m.get('content'))}\x1e")
        return "".join(parts)
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # several prompts: the first one's replica
        return head + prompt if isinstance(prompt, str) else ""
    return ""


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: the text ones, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and "text" in p)
    return "" if content is None else json.dumps(content, sort_keys=True)


def block_keys(
    text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> tuple[int, ...]:
    """Chained keys of ``text``'s whole blocks: key i depends on blocks 0..i."""
    keys: list[int] = []
    chain = b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        chain = hashlib.blake2b(chain + block, digest_size=8).digest()
        keys.append(int.from_bytes(chain, "little"))
    return tuple(keys)


def request_keys(path: str, body: Mapping[str, Any]) -> tuple[int, ...]:
    return block_keys(prompt_text(path, body))


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load: requests on it (running + waiting), and
    the fraction of its KV pool in use (0 when unknown)."""

    replica: Hashable
    requests: int
    kv_usage: float = 0.0


class AffinityTable:
    """Block key -> the replicas it was routed to, most recent last; at most ``capacity``
    keys, the least recently used dropped first."""

    def __init__(self, capacity: int = 200_000, per_key: int = 4) -> None:
        self.capacity = capacity
        self.per_key = per_key
        self._keys: OrderedDict[int, list[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, keys: Sequence[int], replica: Hashable) -> None:
        """``replica`` was sent (and so will cache) every block of ``keys``."""
        for key in keys:
            holders = self._keys.pop(key, [])
            if replica in holders:
                holders.remove(replica)
            holders.append(replica)
            del holders[: -self.per_key]
            self._keys[key] = holders
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def longest(
        self, keys: Sequence[int], among: Iterable[Hashable]
    ) -> tuple[Hashable | None, int]:
        """The replica of ``among`` holding the most leading blocks of ``keys`` (the most
        recently sent, on a tie), and how many blocks."""
        allowed = set(among)
        for depth in range(len(keys), 0, -1):
            holders = self._keys.get(keys[depth - 1])
            if not holders:
                continue
            for replica in reversed(holders):
                if replica in allowed:
                    self._keys.move_to_end(keys[depth - 1])
                    return replica, depth
        return None, 0

    def forget(self, replica: Hashable) -> None:
        """``replica`` is gone (its cache with it)."""
        for key in list(self._keys):
            holders = self._keys[key]
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self._keys[key]


#: Requests a cache-holding replica may have past the least loaded one and still be chosen:
#: a prefix hit saves its prefill (hundreds of ms for a long prompt on a CPU), a queue of a
#: few more requests costs about as much.
IMBALANCE = 4
#: KV use past which a replica's cache is no reason to send it more.
KV_FULL = 0.95


def by_load(loads: Sequence[ReplicaLoad]) -> list[list[Hashable]]:
    """The replicas least loaded first, one per rank (equal loads in the order given: the
    router rotates it). Not equal loads in one rank: Ray Serve picks within a rank by its
    own queue-length cache, which lags a burst (a CI run sent 7 of 8 concurrent requests to
    one replica when both sat in one rank)."""
    return [[r.replica] for r in sorted(loads, key=lambda r: r.requests)]


def rank(
    keys: Sequence[int],
    loads: Sequence[ReplicaLoad],
    table: AffinityTable,
    imbalance: int = IMBALANCE,
) -> list[list[Hashable]]:
    """The replicas in the order to try them, in ranks (the router takes the first rank
    that has room): the replica holding the request's longest cached prefix alone first,
    when its load allows, then the rest by load; else all of them by load."""
    if not loads:
        return []
    everyone = [r.replica for r in loads]
    best, _ = table.longest(keys, everyone) if keys else (None, 0)
    if best is None:
        return by_load(loads)
    least = min(r.requests for r in loads)
    holder = next(r for r in loads if r.replica == best)
    if holder.requests - least > imbalance or holder.kv_usage >= KV_FULL:
        return by_load(loads)
    return [[best], *by_load([r for r in loads if r.replica != best])]
