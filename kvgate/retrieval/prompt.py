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
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"[^\W_]+")
#: What an answer shares with a source, counted in runs: of 4 characters holding a CJK one
#: (Chinese: about two words), or of 3 words of other scripts (4 letters are too common
#: there). At least ``_MIN_SHARED`` runs attribute an answer to a source.
_RUN = 4
_MIN_SHARED = 3
#: Shared runs that make a copied phrase (about 11 characters in a row).
_COPIED = 8
#: Labels checked against their sentence per text; the rest point where they say (a looping
#: answer of 1,000 labels must not cost the server seconds).
_MAX_CHECKED = 32


def _runs(text: str) -> frozenset[str]:
    flat = _SPACE.sub("", _LABEL.sub("", text))
    cjk = {
        flat[i : i + _RUN] for i in range(len(flat) - _RUN + 1) if _CJK.search(flat[i : i + _RUN])
    }
    words = [w for w in _WORD.findall(text.lower()) if not _CJK.search(w)]
    return frozenset(cjk | {" ".join(words[i : i + 3]) for i in range(len(words) - 2)})


def _support(text: str, pools: Sequence[frozenset[str]]) -> list[int]:
    """Runs ``text`` shares with each source (``pools``: each source's ``_runs``)."""
    runs = _runs(text)
    return [len(runs & pool) for pool in pools]


def attributed(
    text: str, results: Sequence[Result], pools: Sequence[frozenset[str]] | None = None
) -> int | None:
    """The index of the source an answer without labels came from, or None: the one it
    copies a phrase from (at least ``_COPIED`` shared runs, the most wins), else the one it
    names by article (``第四十一条`` heading the source), else the one it shares the most
    runs with (at least ``_MIN_SHARED``). Copying comes before naming because a small model
    misnumbers the clause it quotes (Qwen2.5-1.5B on the legal corpus: 第十六条's words
    under the name 第十五条). ``pools``: the sources' runs, from what the prompt showed."""
    pools = pools if pools is not None else [_runs(r.text) for r in results]
    shared = _support(text, pools)
    best = max(range(len(results)), key=lambda i: (shared[i], -i), default=None)
    if best is not None and shared[best] >= _COPIED:
        return best
    named = set(_ARTICLE.findall(text))
    for i, r in enumerate(results):
        heading = _ARTICLE.match(r.text.lstrip())
        if heading is not None and heading.group(0) in named:
            return i
    return best if best is not None and shared[best] >= _MIN_SHARED else None


#: Where a sentence ends: Chinese and Latin stops, a semicolon, a line's end.
_SENTENCE_END = re.compile(r"[。！？!?；;\n]|\.(?=\s|$)")
_CLOSES = re.compile(r"(?:[。！？!?；;]|\.)(?:[ \t]*\[\d{1,3}\])*[ \t]*\Z")


def _sentence(text: str, label: re.Match[str]) -> str:
    """The sentence a label cites: the one it closes when it follows a sentence's end
    (``…一日。[3]``, also after other labels: ``…一日。[1][3]``), the one it opens at the
    start of a line or of the text, else the one it stands in (``根据[3]的规定，…。``)."""
    start, end = label.start(), label.end()
    head = text[:start]
    closing = _CLOSES.search(head)
    if closing is not None:  # the sentence before the stop
        stop = closing.start()
        before = [m.end() for m in _SENTENCE_END.finditer(text, 0, stop)]
        return text[before[-1] if before else 0 : stop]
    line_start = head.rstrip(" \t").endswith("\n") or not head.strip()
    after = _SENTENCE_END.search(text, end)
    if line_start:
        return text[end : after.start() if after else len(text)]
    before = [m.end() for m in _SENTENCE_END.finditer(text, 0, start)]
    return text[before[-1] if before else 0 : after.start() if after else len(text)]


def _checked(text: str, label: re.Match[str], pools: Sequence[frozenset[str]]) -> int:
    """The source a label points at, unless the sentence it cites copies at least twice as
    many runs from another source (and at least ``_MIN_SHARED``): a small model often
    quotes one source and writes another's label (measured with Qwen2.5-1.5B on the legal
    corpus: the quoted article under the label of its neighbour in the prompt)."""
    n = int(label.group(1)) - 1
    shared = _support(_sentence(text, label), pools)
    best = max(range(len(pools)), key=lambda i: (shared[i], -i))
    if shared[best] >= _MIN_SHARED and shared[best] >= 2 * shared[n] and best != n:
        return best
    return n


def cited(
    text: str, results: Sequence[Result], shown: Sequence[str] | None = None
) -> list[tuple[int, int]]:
    """(source index, where in ``text`` the citation ends) for each source ``text`` cites by
    its ``[n]`` label (n in range), the first ``_MAX_CHECKED`` checked against what the
    labelled sentence copies (``_checked``); a text with no label in range is attributed to
    the source it copies or names (``attributed``), at its end; none when it does neither.
    ``shown``: each result's text as the prompt showed it (with its neighbours), if not
    ``results[i].text``."""
    labels = [m for m in _LABEL.finditer(text) if 1 <= int(m.group(1)) <= len(results)]
    if not text or not results:
        return []
    pools = [_runs(t) for t in (shown if shown is not None else [r.text for r in results])]
    out = [
        (_checked(text, m, pools) if i < _MAX_CHECKED else int(m.group(1)) - 1, m.end())
        for i, m in enumerate(labels)
    ]
    if not out:
        j = attributed(text, results, pools)
        if j is not None:
            out.append((j, len(text)))
    return out


def citations(
    text: str, results: Sequence[Result], shown: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """``file_citation`` annotations for what ``text`` cites (``cited``); a text that cites
    nothing that way gets one for the best source at its end."""
    out = [_citation(results[i], end) for i, end in cited(text, results, shown)]
    if not out and results and text:
        out.append(_citation(results[0], len(text)))
    return out


def _citation(r: Result, index: int) -> dict[str, Any]:
    return {"type": "file_citation", "index": index, "file_id": r.file_id, "filename": r.filename}
