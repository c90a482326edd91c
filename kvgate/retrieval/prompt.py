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


#: Verdict, number or rule first (what a reader looks for, and what is graded: docs'
#: ``grading.py``), then the clause with its label; brief, since on a CPU every token of the
#: answer costs a decode step.
INSTRUCTIONS = (
    "Answer the question using only the sources below, in the language of the question. "
    "First give the answer itself in one sentence (yes or no, the number with its unit, or "
    "the rule), then the clause it rests on, citing its source by label, like [1]. Be brief. "
    "If the sources do not answer it, say so.\n\nSources:\n\n"
)


def sources_block(sources: Sequence[Source]) -> str:
    return INSTRUCTIONS + "\n\n".join(s.render() for s in sources)


_LABEL = re.compile(r"\[(\d{1,3})\]")
_ARTICLE = re.compile(r"第[零〇一二两三四五六七八九十百千0-9]+条(?:之[一二三四五六七八九十]+)?")
_SPACE = re.compile(r"\s+")
#: Runs of this many characters shared with a source attribute an unlabelled answer to it
#: (Chinese: 4 characters is about two words), and at least this many runs must be shared.
_RUN = 4
_MIN_SHARED = 3
#: Shared runs that make a copied phrase (about 11 characters in a row).
_COPIED = 8


def _runs(text: str) -> set[str]:
    flat = _SPACE.sub("", text)
    return {flat[i : i + _RUN] for i in range(len(flat) - _RUN + 1)}


def _support(text: str, results: Sequence[Result]) -> list[int]:
    """Runs of ``_RUN`` characters ``text`` shares with each result."""
    runs = _runs(_LABEL.sub("", text))
    return [len(runs & _runs(r.text)) for r in results]


def attributed(text: str, results: Sequence[Result]) -> int | None:
    """The index of the source an answer without labels came from, or None: the one it
    copies a phrase from (at least ``_COPIED`` shared runs of 4 characters, the most
    wins), else the one it names by article (``第四十一条`` heading the source), else the
    one it shares the most runs with (at least ``_MIN_SHARED``). Copying comes before
    naming because a small model misnumbers the clause it quotes (Qwen2.5-1.5B on the legal
    corpus: 第十六条's words under the name 第十五条)."""
    shared = _support(text, results)
    best = max(range(len(results)), key=lambda i: (shared[i], -i), default=None)
    if best is not None and shared[best] >= _COPIED:
        return best
    named = set(_ARTICLE.findall(text))
    for i, r in enumerate(results):
        heading = _ARTICLE.match(r.text.lstrip())
        if heading is not None and heading.group(0) in named:
            return i
    return best if best is not None and shared[best] >= _MIN_SHARED else None


_SENTENCE_END = re.compile(r"[。！？!?\n]")


def _sentence(text: str, label: re.Match[str]) -> str:
    """The sentence a label cites: the one it closes when it follows a sentence's end
    (``…一日。[3]``), else the one it stands in (``根据[3]的规定，…。``)."""
    start, end = label.start(), label.end()
    closes = start > 0 and _SENTENCE_END.match(text, start - 1) is not None
    if closes:
        end = start - 1
        start -= 1
    before = [m.end() for m in _SENTENCE_END.finditer(text, 0, start)]
    after = None if closes else _SENTENCE_END.search(text, end)
    return text[before[-1] if before else 0 : after.start() if after else end]


def _checked(text: str, label: re.Match[str], results: Sequence[Result]) -> int:
    """The source a label points at, unless the sentence it cites copies at least twice as
    many runs from another source (and at least ``_MIN_SHARED``): a small model often
    quotes one source and writes another's label (measured with Qwen2.5-1.5B on the legal
    corpus: the quoted article under the label of its neighbour in the prompt)."""
    n = int(label.group(1)) - 1
    shared = _support(_sentence(text, label), results)
    best = max(range(len(results)), key=lambda i: (shared[i], -i))
    if shared[best] >= _MIN_SHARED and shared[best] >= 2 * shared[n] and best != n:
        return best
    return n


def cited(text: str, results: Sequence[Result]) -> list[tuple[int, int]]:
    """(source index, where in ``text`` the citation ends) for each source ``text`` cites by
    its ``[n]`` label, checked against what the labelled sentence copies (``_checked``); a
    text with no label is attributed to the source it names or copies (``attributed``), at
    its end; none when it does neither."""
    out = [
        (_checked(text, m, results), m.end())
        for m in _LABEL.finditer(text)
        if 1 <= int(m.group(1)) <= len(results)
    ]
    if not out and text:
        i = attributed(text, results)
        if i is not None:
            out.append((i, len(text)))
    return out


def citations(text: str, results: Sequence[Result]) -> list[dict[str, Any]]:
    """``file_citation`` annotations for what ``text`` cites (``cited``); a text that cites
    nothing that way gets one for the best source at its end."""
    out = [_citation(results[i], end) for i, end in cited(text, results)]
    if not out and results and text:
        out.append(_citation(results[0], len(text)))
    return out


def _citation(r: Result, index: int) -> dict[str, Any]:
    return {"type": "file_citation", "index": index, "file_id": r.file_id, "filename": r.filename}
