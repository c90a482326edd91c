"""Splitting a document's text into chunks that carry where they lie.

``auto`` (kvgate's): structure first. Headings (Markdown ``#`` and underlined ones,
outside code fences; the 编 / 分编 / 章 / 节 of Chinese laws, as Markdown or as plain lines;
Part / Chapter / Section lines; numbered headings ``1.2 Title``, ``1.2. 标题``, ``1.2　标题``;
any of these set in bold on a line of its own) build a heading path; units start under them
at each article (第X条, ``Article 5``), at an appendix (附录, 附件), and, outside articles, at
each top-level clause of a contract (一、…, labelled with its title where its line is one:
``一、合同标的``). A unit is one chunk when it fits the token cap; a longer one is cut at
paragraph and sentence ends (。！？；!?;), with overlap between its pieces, and only inside a
sentence when a sentence alone is over the cap. Every 第X条 starts a chunk.

``static`` (OpenAI's): windows of ``max_tokens`` sliding by ``max_tokens - overlap``.

Every chunk is an exact slice of the text: ``text[chunk.start:chunk.end] == chunk.text``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: Tokens of a text, by the tokenizer the cap is meant for (the embedder's).
TokenCounter = Callable[[str], int]

_NUM = "零〇一二三四五六七八九十百千万两0-9０-９"
_MD_HEADING = re.compile(r"(#{1,6})[ \t]+(.+?)[ \t#]*$")
_LAW_HEADING = re.compile(rf"[ \t　]*\**(第[{_NUM}]+(分编|编|章|节))\**(?:[ \t　]+|$)(.*)$")
_LAW_LEVEL = {"编": 1, "分编": 2, "章": 3, "节": 4}
#: Numbered headings: "1 Title", "1.2 Title", "1.2. Title", "1.2　标题" (ideographic space).
#: A bare "1." is a list item; "3.5倍" (no space) is a quantity, not a heading.
_NUMBERED_HEADING = re.compile(r"(\d+(?:\.\d+)+\.?|\d+)[ \t\u3000]+([^\s\d].{0,60})$")
#: English structure as plain lines: Part > Chapter > Section.
_EN_HEADING = re.compile(r"[ \t]*(PART|Part|CHAPTER|Chapter|SECTION|Section)[ \t]+([0-9IVXLC]+)\b")
_EN_LEVEL = {"part": 1, "chapter": 2, "section": 3}
_EN_ARTICLE = re.compile(
    r"[ \t]*\**((?:ARTICLE|Article)[ \t]+[0-9IVXLC]+(?:\.[0-9]+)*)\**(?:[.:\s]|$)"
)
_BOLD_LINE = re.compile(r"[ \t]*(?:\*\*|__)([^*_].*?)(?:\*\*|__)[ \t]*")
_SETEXT = re.compile(r"[ \t]*(=+|-+)[ \t]*$")
_ARTICLE = re.compile(rf"[ \t　]*\**(第[{_NUM}]+条(?:之[{_NUM}]+)?)\**(?:[ \t　]|$)")
_APPENDIX = re.compile(
    r"[ \t　]*\**((?:附录|附件|附表)[一二三四五六七八九十0-9]*)\**[ \t　]*[：:]?\**[ \t　]*$"
)
_CLAUSE = re.compile(r"[ \t　]*\**([一二三四五六七八九十百]+)、")
#: A code fence's opening or closing line (CommonMark's, but at any indent, as fences in
#: list items are): 3 or more backticks or tildes; a closing one has only spaces after it.
_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})(.*)$")
_SENTENCE_END = re.compile(r"[。！？；!?;]+[”’」』）)]*|\n\s*\n|\n")


@dataclass(frozen=True)
class Chunk:
    text: str  # == the document's text[start:end]
    start: int  # character offsets into the document's text
    end: int
    #: The heading path, then the unit's own label (e.g. 第五百零九条) where it has one.
    section: tuple[str, ...] = ()

    @property
    def section_path(self) -> str:
        return " / ".join(self.section)


@dataclass(frozen=True)
class _Unit:
    start: int
    end: int
    section: tuple[str, ...]


def _lines(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, line) without its newline."""
    pos = 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        yield pos, pos + len(body), body
        pos += len(line)


def _title(raw: str) -> str:
    return re.sub(r"[\s\u200b]+", " ", raw.replace("*", "")).strip()


def _heading(line: str, markdown_levels: bool) -> tuple[int, str] | None:
    """(level, title) when the line is a heading."""
    m = _MD_HEADING.match(line)
    if m is not None:
        return len(m.group(1)), _title(m.group(2))
    bold = _BOLD_LINE.fullmatch(line)  # "**4.1 交付地点**": a heading set in bold
    line = bold.group(1) if bold is not None else line
    m = _LAW_HEADING.match(line)
    if m is not None and len(line) <= 60 and not line.rstrip().endswith(("。", "；", "：")):
        # As plain lines, the law's own hierarchy; +1 below a Markdown document's title.
        level = _LAW_LEVEL[m.group(2)] + (1 if markdown_levels else 0)
        return level, _title(f"{m.group(1)} {m.group(3)}")
    ends = ("。", ".", "；", ";", "：", ":", "，", ",")
    m = _EN_HEADING.match(line)
    if m is not None and len(line) <= 80 and not line.rstrip().endswith(ends):
        level = _EN_LEVEL[m.group(1).lower()] + (1 if markdown_levels else 0)
        return level, _title(line)
    m = _NUMBERED_HEADING.match(line)
    if m is not None and " | " not in line and not line.rstrip().endswith(ends):
        return m.group(1).rstrip(".").count(".") + 1, _title(line)  # not a table's row
    return None


def marks_structure(line: str) -> bool:
    """Whether ``line`` starts an article, an appendix or a part of a law or book (第三条,
    附件2, 第二章, Chapter 4, Article 5): a line that must stay where it is, even where it
    repeats at the top of every page."""
    return any(
        p.match(line) is not None
        for p in (_ARTICLE, _EN_ARTICLE, _APPENDIX, _LAW_HEADING, _EN_HEADING)
    )


def _label(
    line: str, article: re.Match[str] | None, clause: re.Match[str] | None, alone: bool
) -> str:
    """A unit's own label: its article (第五条), or its clause with the clause's title where
    the line is one: a paragraph of its own ("一、合同标的", "一、付款方式："), short, not a
    sentence; else "一、" (a sentence, or a line that wraps on)."""
    if article is not None or clause is None:
        return article.group(1) if article is not None else ""
    rest = _title(line[clause.end() :]).rstrip("：:").strip()
    if alone and rest and len(rest) <= 30 and not re.search(r"[。！？；，,;:：]", rest):
        return f"{clause.group(1)}、{rest}"
    return clause.group(1) + "、"


_TEXT, _FENCE_LINE, _CODE = 0, 1, 2


def _fences(lines: list[tuple[int, int, str]]) -> list[int]:
    """Per line: ``_FENCE_LINE`` (a fence opens or closes there), ``_CODE`` (inside a fenced
    block) or ``_TEXT``. A block closes only at a fence of its own character at least as long
    ("````" around a Markdown example holding "```" stays open). A fence that nothing closes
    is read as text: "``` end" or a "~~~ 分隔 ~~~" rule must not swallow the articles after it.
    """
    found = [_FENCE.match(line) for _, _, line in lines]
    # closers[c][i]: the longest fence of character c that could close a block, at or after i.
    closers = {c: [0] * (len(lines) + 1) for c in "`~"}
    for i in range(len(lines) - 1, -1, -1):
        for c, best in closers.items():
            m = found[i]
            own = len(m.group(1)) if m and m.group(1)[0] == c and not m.group(2).strip() else 0
            best[i] = max(best[i + 1], own)
    out: list[int] = []
    opened: str | None = None  # the open fence's run, e.g. "````"
    for i, m in enumerate(found):
        if opened is None:
            opens = m is not None and not (m.group(1)[0] == "`" and "`" in m.group(2))
            if opens and m is not None and closers[m.group(1)[0]][i + 1] >= len(m.group(1)):
                opened = m.group(1)
                out.append(_FENCE_LINE)
            else:
                out.append(_TEXT)
        elif (
            m is not None
            and m.group(1)[0] == opened[0]
            and len(m.group(1)) >= len(opened)
            and not m.group(2).strip()
        ):
            opened = None
            out.append(_FENCE_LINE)
        else:
            out.append(_CODE)
    return out


def _setext_titles(lines: list[tuple[int, int, str]], fences: list[int]) -> dict[int, int]:
    """Markdown's underlined headings: line index of the title -> its level (``===`` 1,
    ``---`` 2); the underline itself is the next line. Not inside code fences."""
    titles: dict[int, int] = {}
    for i, (_, _, line) in enumerate(lines):
        m = _SETEXT.match(line)
        if fences[i] != _TEXT or m is None or len(m.group(1)) < 3 or i == 0:
            continue
        if fences[i - 1] != _TEXT:
            continue
        title = lines[i - 1][2]
        if title.strip() and not _SETEXT.match(title) and not title.startswith(("#", " " * 4)):
            titles[i - 1] = 1 if m.group(1)[0] == "=" else 2
    return titles


def _units(text: str) -> list[_Unit]:
    """The document cut at headings and unit starts; each unit with its section path."""
    path: list[tuple[int, str]] = []  # (level, title) of the open headings
    units: list[_Unit] = []
    start: int | None = None
    label: str | None = None
    in_article = False
    lines = list(_lines(text))
    fences = _fences(lines)
    setext = _setext_titles(lines, fences)
    markdown_levels = bool(setext) or bool(re.search(r"(?m)^#{1,6}[ \t]", text))

    def close(end: int) -> None:
        nonlocal start
        if start is not None and text[start:end].strip():
            section = tuple(t for _, t in path) + ((label,) if label else ())
            units.append(_Unit(start, end, section))
        start = None

    underlines = {i + 1 for i in setext}
    for n, (lo, _, line) in enumerate(lines):
        if n in underlines:
            continue  # the line under a setext title
        if fences[n] == _FENCE_LINE:
            if start is None:
                start = lo
            continue
        in_fence = fences[n] == _CODE
        heading = None if in_fence else _heading(line, markdown_levels)
        if n in setext:
            heading = (setext[n], _title(line))
        if heading is not None:
            close(lo)
            level, title = heading
            while path and path[-1][0] >= level:
                path.pop()
            path.append((level, title))
            label, in_article = None, False
            continue
        appendix = None if in_fence else _APPENDIX.match(line)
        if appendix is not None:  # a heading just below the document's title
            close(lo)
            level = 2 if markdown_levels else 1
            while path and path[-1][0] >= level:
                path.pop()
            path.append((level, appendix.group(1)))
            start, label, in_article = lo, None, False
            continue
        if not in_fence:
            article = _ARTICLE.match(line) or _EN_ARTICLE.match(line)
            clause = None if article or in_article else _CLAUSE.match(line)
            marker = article or clause
            if marker is not None:
                close(lo)
                alone = n + 1 == len(lines) or not lines[n + 1][2].strip()  # a paragraph
                start, label = lo, _label(line, article, clause, alone)
                in_article = article is not None
                continue
        if start is None and line.strip():
            start, label = lo, None
    close(len(text))
    return units


def _trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start] in " \t\r\n\u3000\u200b":
        start += 1
    while end > start and text[end - 1] in " \t\r\n\u3000\u200b":
        end -= 1
    return start, end


def _pieces(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The span cut after each sentence end and line break: the places a chunk may end."""
    out, pos = [], start
    for m in _SENTENCE_END.finditer(text, start, end):
        if m.end() > pos:
            out.append((pos, m.end()))
            pos = m.end()
    if pos < end:
        out.append((pos, end))
    return out


def _hard_cut(text: str, start: int, end: int, cap: int, count: TokenCounter) -> int:
    """The furthest end in (start, end] with at most ``cap`` tokens (at least one char).

    The span searched grows by doubling from ``cap`` characters first, so each count reads
    about a window's text, not the rest of the document (which made long files quadratic)."""
    lo, hi = start + 1, min(end, start + max(cap, 1))
    while hi < end and count(text[start:hi]) <= cap:
        lo = hi
        hi = min(end, start + 2 * (hi - start))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[start:mid]) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _split(
    text: str, unit: _Unit, cap: int, overlap: int, count: TokenCounter
) -> Iterator[tuple[int, int]]:
    """A unit over the cap as spans of at most ``cap`` tokens, at sentence ends where it can,
    each after the first beginning with up to ``overlap`` tokens of the one before."""
    pieces: list[tuple[int, int]] = []
    for a, b in _pieces(text, unit.start, unit.end):
        while a < b:  # a sentence over the cap is cut inside it
            cut = _hard_cut(text, a, b, cap, count)
            pieces.append((a, cut))
            a = cut
    i = 0
    while i < len(pieces):
        j = i + 1  # pieces[i:j] go in this span: as many as fit
        while j < len(pieces) and count(text[pieces[i][0] : pieces[j][1]]) <= cap:
            j += 1
        yield pieces[i][0], pieces[j - 1][1]
        if j == len(pieces):
            return
        # The next span starts this far back: whole pieces of at most ``overlap`` tokens.
        k = j
        while (
            k - 1 > i
            and count(text[pieces[k - 1][0] : pieces[j][1]]) <= cap
            and (count(text[pieces[k - 1][0] : pieces[j - 1][1]]) <= overlap)
        ):
            k -= 1
        i = k


def chunk_auto(
    text: str, count: TokenCounter, max_tokens: int = 400, overlap_tokens: int = 64
) -> list[Chunk]:
    """Structure-aware chunks (module docstring); none over ``max_tokens``."""
    if max_tokens <= 0 or not 0 <= overlap_tokens < max_tokens:
        raise ValueError("need max_tokens > 0 and 0 <= overlap_tokens < max_tokens")
    chunks = []
    for unit in _units(text):
        start, end = _trimmed(text, unit.start, unit.end)
        if start == end:
            continue
        unit = _Unit(start, end, unit.section)
        spans = (
            [(start, end)]
            if count(text[start:end]) <= max_tokens
            else _split(text, unit, max_tokens, overlap_tokens, count)
        )
        for a, b in spans:
            a, b = _trimmed(text, a, b)
            if a < b:
                chunks.append(Chunk(text[a:b], a, b, unit.section))
    return chunks


def chunk_static(
    text: str, count: TokenCounter, max_tokens: int = 800, overlap_tokens: int = 400
) -> list[Chunk]:
    """OpenAI's static chunking: windows of at most ``max_tokens``, each starting
    ``overlap_tokens`` before the previous one ended; no structure, no section."""
    if max_tokens <= 0 or not 0 <= overlap_tokens <= max_tokens // 2:
        raise ValueError("need max_tokens > 0 and 0 <= overlap_tokens <= max_tokens / 2")
    chunks = []
    start, n = 0, len(text)
    while start < n:
        end = _hard_cut(text, start, n, max_tokens, count)
        a, b = _trimmed(text, start, end)
        if a < b:
            chunks.append(Chunk(text[a:b], a, b))
        if end >= n:
            break
        if not overlap_tokens:
            start = end
            continue
        # The earliest start whose overlap with this window holds at most overlap_tokens;
        # always forward.
        lo, hi = start + 1, end
        while lo < hi:
            mid = (lo + hi) // 2
            if count(text[mid:end]) <= overlap_tokens:
                hi = mid
            else:
                lo = mid + 1
        start = lo
    return chunks
