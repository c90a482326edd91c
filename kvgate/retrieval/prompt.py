"""Retrieved chunks into a prompt, and the model's citations back out.

Position-aware: language models read the start and the end of a long context best and lose
the middle, so the best-ranked source goes first, the second-best last, the third second,
and so on inwards. Every source is labelled ``[n]`` (n = its rank) with its document and
heading path, and the model is asked to cite by label; what does not fit the context budget
is dropped from the lowest rank up, and said so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Result(Protocol):
    @property
    def file_id(self) -> str: ...
    @property
    def filename(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def attributes(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Source:
    label: int  # [label] in the prompt: the rank, from 1
    result: Result

    def render(self) -> str:
        section = self.result.attributes.get("section") or ""
        where = f" {section}" if section else ""
        return f"[{self.label}] ({self.result.filename}){where}\n{self.result.text}"


def arrange(results: Sequence[Result]) -> list[Source]:
    """Ranks 1, 3, 5, ... from the start, then ..., 6, 4, 2 to the end."""
    sources = [Source(i + 1, r) for i, r in enumerate(results)]
    return sources[0::2] + sources[1::2][::-1]


def fit(
    results: Sequence[Sequence[Result]], count_tokens: Callable[[str], int], budget: int
) -> tuple[list[Result], int]:
    """The best-ranked results whose rendered sources fit ``budget`` tokens, and how many
    were dropped. Each rank gives its choices, widest first (a chunk with its neighbours,
    then the chunk alone): the first that fits is taken."""
    kept: list[Result] = []
    used = 0
    for i, choices in enumerate(results):
        for r in choices:
            cost = count_tokens(Source(i + 1, r).render()) + 2
            if used + cost <= budget:
                kept.append(r)
                used += cost
                break
        else:
            return kept, len(results) - len(kept)
    return kept, 0


INSTRUCTIONS = (
    "Answer the question using only the sources below. Cite the sources you use by their "
    "label, like [1]. If the sources do not answer it, say so.\n\nSources:\n\n"
)


def sources_block(sources: Sequence[Source]) -> str:
    return INSTRUCTIONS + "\n\n".join(s.render() for s in sources)


_LABEL = re.compile(r"\[(\d{1,3})\]")


def citations(text: str, results: Sequence[Result]) -> list[dict[str, Any]]:
    """``file_citation`` annotations for the ``[n]`` labels in ``text`` (the index is where
    the label ends); a text that cites nothing gets one for the best source at its end."""
    out: list[dict[str, Any]] = []
    for m in _LABEL.finditer(text):
        n = int(m.group(1))
        if 1 <= n <= len(results):
            r = results[n - 1]
            out.append(_citation(r, m.end()))
    if not out and results and text:
        out.append(_citation(results[0], len(text)))
    return out


def _citation(r: Result, index: int) -> dict[str, Any]:
    return {"type": "file_citation", "index": index, "file_id": r.file_id, "filename": r.filename}
