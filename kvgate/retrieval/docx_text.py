"""A Word document's text (.docx) as the chunker reads it: what Word shows, in order.

Read from the document's XML (python-docx parses the package); what a reader sees that a
paragraph's runs do not hold:

- **Automatic numbering** (``numbering.xml``): the label Word draws before a numbered
  paragraph, e.g. ``第一条`` (``lvlText`` "第%1条", ``chineseCounting``), ``1.2`` ("%1.%2"),
  ``（一）``. Chinese contracts and regulations drafted in Word number their articles this
  way; without the label the chunker finds no 第X条 and a citation names no article.
  Counters run per list (``abstractNum``, which the ``num`` instances of one list share,
  a ``numStyleLink`` followed to its list); a level's advance restarts the levels below
  it; a ``num``'s ``lvlOverride`` (a ``startOverride``, or a whole level) applies where
  that ``num`` is used. A paragraph's numId and level each come from the nearest of the
  paragraph and its styles (numbered headings). Numbered paragraphs in table cells count.
- **Tables**: a row a line, its cells joined by `` | `` (a merged cell once, nested tables'
  text in their cell), in their place between the paragraphs.
- **Headings**: the Heading N styles, or an outline level, as Markdown ``#`` lines; a Title
  paragraph as ``#``, the headings then one level below it (at most ``######``).
- Text in tracked insertions, fields' results and content controls; not deleted text, field
  codes or text boxes (whose fallback copies would repeat them).

Skipped: a table of contents (its ``TOC N`` lines would read as a second copy of every
heading and article), headers, footers, footnotes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from docx.oxml.ns import qn

_DIGITS = "零一二三四五六七八九"
_LEGAL_DIGITS = "零壹贰叁肆伍陆柒捌玖"
_TRADITIONAL = "甲乙丙丁戊己庚辛壬癸"
_ZODIAC = "子丑寅卯辰巳午未申酉戌亥"
_FULL_WIDTH = str.maketrans("0123456789", "０１２３４５６７８９")
_ROMAN = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))  # fmt: skip
#: Enclosed numerals: the first code point (for 1) and how many there are.
_ENCLOSED = {
    "decimalEnclosedCircle": (0x2460, 20),  # ①
    "decimalEnclosedCircleChinese": (0x2460, 20),
    "decimalEnclosedParen": (0x2474, 20),  # ⑴
    "decimalEnclosedFullstop": (0x2488, 20),  # ⒈
    "ideographEnclosedCircle": (0x3220, 10),  # ㈠
}
_COUNTING = frozenset({
    "chineseCounting", "chineseCountingThousand", "japaneseCounting", "koreanCounting",
    "taiwaneseCounting", "taiwaneseCountingThousand", "ideographDigital",
})  # fmt: skip
_LEGAL = frozenset({"chineseLegalSimplified", "ideographLegalTraditional", "japaneseLegal"})


def chinese_number(n: int, legal: bool = False) -> str:
    """``n`` in Chinese numerals as Word counts: 10 十, 11 十一, 110 一百一十, 1010 一千零一十;
    ``legal``: 壹拾, 壹佰壹拾 (the financial forms, which keep every 壹)."""
    if n <= 0:
        return str(n)
    digits, units = (_LEGAL_DIGITS, "拾佰仟") if legal else (_DIGITS, "十百千")
    if n >= 10000:
        high, low = divmod(n, 10000)
        out = chinese_number(high, legal) + ("萬" if legal else "万")
        if low:
            out += ("零" if low < 1000 else "") + _below_10000(low, digits, units, True)
        return out
    return _below_10000(n, digits, units, legal)


def _below_10000(n: int, digits: str, units: str, keep_one: bool) -> str:
    out, zero = "", False
    for power in (3, 2, 1, 0):
        d = n // 10**power % 10
        if d == 0:
            zero = bool(out)
            continue
        if zero:
            out += digits[0]
            zero = False
        if not (power == 1 and d == 1 and not out and not keep_one):
            out += digits[d]
        out += units[power - 1] if power else ""
    return out


def format_number(n: int, fmt: str) -> str:
    """``n`` in the ``w:numFmt`` ``fmt``; formats kvgate does not draw fall back to decimal."""
    if fmt in _COUNTING:
        return chinese_number(n)
    if fmt in _LEGAL:
        return chinese_number(n, legal=True)
    if fmt in ("upperLetter", "lowerLetter"):
        letter = chr(ord("A") + (n - 1) % 26) * ((n - 1) // 26 + 1)
        return letter if fmt == "upperLetter" else letter.lower()
    if fmt in ("upperRoman", "lowerRoman") and 0 < n < 4000:
        roman, rest = "", n
        for value, numeral in _ROMAN:
            while rest >= value:
                roman, rest = roman + numeral, rest - value
        return roman if fmt == "upperRoman" else roman.lower()
    if fmt == "ideographTraditional" and 0 < n <= len(_TRADITIONAL):
        return _TRADITIONAL[n - 1]
    if fmt == "ideographZodiac" and 0 < n <= len(_ZODIAC):
        return _ZODIAC[n - 1]
    if fmt in _ENCLOSED and 0 < n <= _ENCLOSED[fmt][1]:
        return chr(_ENCLOSED[fmt][0] + n - 1)
    if fmt in ("decimalFullWidth", "decimalFullWidth2"):
        return str(n).translate(_FULL_WIDTH)
    if fmt == "decimalZero":
        return f"{n:02d}"
    return str(n)


_MAX_COUNT = 32767  # Word's own limit on a list's start value


def _int(value: str | None) -> int:
    """A count attribute, within 0 .. _MAX_COUNT; 0 where it is absent or not a number (a
    damaged file's lists are then numbered from 0, not refused)."""
    try:
        return min(max(int(value), 0), _MAX_COUNT) if value is not None else 0
    except ValueError:
        return 0


def _val(element: Any, tag: str) -> str | None:
    """The ``w:val`` of ``element``'s child ``tag``, or None."""
    child = None if element is None else element.find(qn(tag))
    return None if child is None else child.get(qn("w:val"))


@dataclass(frozen=True)
class _Style:
    """A paragraph style with the styles it is based on, nearest first."""

    style_id: str
    names: tuple[str, ...]  # lower case, as styles.xml writes built-in names
    prs: tuple[Any, ...]  # their w:pPr elements (None where one has none)


class _Styles:
    """styles.xml's paragraph styles, indexed once (python-docx's ``paragraph.style`` scans
    every style per lookup: a 20,000-paragraph document took minutes)."""

    def __init__(self, document: Any) -> None:
        self._raw: dict[str, tuple[str, str | None, Any]] = {}
        self.numbering: dict[str, str] = {}  # numbering style id -> its numId
        self.default = ""
        for style in document.styles.element.findall(qn("w:style")):
            kind, sid = style.get(qn("w:type")), style.get(qn("w:styleId")) or ""
            pr = style.find(qn("w:pPr"))
            if kind == "numbering":
                num_id = _val(None if pr is None else pr.find(qn("w:numPr")), "w:numId")
                if num_id is not None:
                    self.numbering[sid] = num_id
            if kind != "paragraph":
                continue
            name = (_val(style, "w:name") or "").lower()
            self._raw[sid] = (name, _val(style, "w:basedOn"), pr)
            if style.get(qn("w:default")) in ("1", "true", "on"):
                self.default = sid
        self._chains: dict[str, _Style] = {}

    def of(self, paragraph: Any) -> _Style:
        """The style of a ``w:p`` element (the default paragraph style where it names none
        or one that does not exist)."""
        sid = _val(paragraph.find(qn("w:pPr")), "w:pStyle") or self.default
        if sid not in self._raw:
            sid = self.default
        if sid not in self._chains:
            names, prs, at, seen = [], [], sid, set()
            while at in self._raw and at not in seen:  # a basedOn cycle ends it
                seen.add(at)
                name, based_on, pr = self._raw[at]
                names.append(name)
                prs.append(pr)
                at = based_on or ""
            self._chains[sid] = _Style(sid, tuple(names), tuple(prs))
        return self._chains[sid]


@dataclass(frozen=True)
class _Level:
    start: int
    fmt: str
    text: str  # w:lvlText, "%1" .. "%9" standing for the levels' numbers
    suffix: str  # after the label: w:suff tab (drawn as a space), space or nothing
    legal: bool  # w:isLgl: every level's number in decimal
    style: str | None  # w:pStyle: the paragraph style this level belongs to

    @staticmethod
    def of(lvl: Any) -> _Level:
        return _Level(
            start=_int(_val(lvl, "w:start")),
            fmt=_val(lvl, "w:numFmt") or "decimal",
            text=_val(lvl, "w:lvlText") or "",
            suffix=_val(lvl, "w:suff") or "tab",
            legal=lvl.find(qn("w:isLgl")) is not None,
            style=_val(lvl, "w:pStyle"),
        )


@dataclass(frozen=True)
class _Num:
    abstract: str  # its abstractNumId
    starts: dict[int, int]  # level -> w:startOverride
    levels: dict[int, _Level]  # level -> a whole w:lvl of a w:lvlOverride


@dataclass
class _Numbering:
    """numbering.xml's lists, and the counters as the body is read in order."""

    styles: _Styles
    levels: dict[str, dict[int, _Level]] = field(default_factory=dict)  # abstractNumId ->
    links: dict[str, str] = field(default_factory=dict)  # abstractNumId -> numStyleLink
    nums: dict[str, _Num] = field(default_factory=dict)  # numId ->
    counters: dict[str, dict[int, int]] = field(default_factory=dict)  # abstractNumId ->
    seen: set[str] = field(default_factory=set)  # numIds whose start overrides are applied

    @classmethod
    def of(cls, document: Any, styles: _Styles) -> _Numbering:
        out = cls(styles)
        try:
            root = document.part.numbering_part.element
        except (NotImplementedError, KeyError):
            return out  # no numbering part
        for abstract in root.findall(qn("w:abstractNum")):
            aid = abstract.get(qn("w:abstractNumId")) or ""
            lvls = abstract.findall(qn("w:lvl"))
            out.levels[aid] = {_int(lvl.get(qn("w:ilvl"))): _Level.of(lvl) for lvl in lvls}
            link = _val(abstract, "w:numStyleLink")
            if link is not None:
                out.links[aid] = link
        for num in root.findall(qn("w:num")):
            starts, levels = {}, {}
            for override in num.findall(qn("w:lvlOverride")):
                ilvl = _int(override.get(qn("w:ilvl")))
                start = _val(override, "w:startOverride")
                if start is not None:
                    starts[ilvl] = _int(start)
                lvl = override.find(qn("w:lvl"))
                if lvl is not None:  # a level of its own restarts at its own start
                    levels[ilvl] = _Level.of(lvl)
                    starts.setdefault(ilvl, levels[ilvl].start)
            num_id = num.get(qn("w:numId")) or ""
            out.nums[num_id] = _Num(_val(num, "w:abstractNumId") or "", starts, levels)
        return out

    def _list(self, num_id: str) -> tuple[str, dict[int, _Level]] | None:
        """(the list's abstractNumId, its levels) for a numId, through numStyleLink."""
        num = self.nums.get(num_id)
        for _ in range(4):  # a link points at a numbering style whose num holds the list
            if num is None:
                return None
            if num.abstract in self.links and not self.levels.get(num.abstract):
                num = self.nums.get(self.styles.numbering.get(self.links[num.abstract], ""))
                continue
            return num.abstract, {**self.levels.get(num.abstract, {}), **num.levels}
        return None

    def label(self, paragraph: Any, style: _Style) -> str:
        """The number Word draws before the ``w:p`` ``paragraph`` (with its separator), or "";
        advances the counters: call once per paragraph, in document order."""
        found = _num_pr(paragraph, style)
        listed = None if found is None else self._list(found[0])
        if found is None or listed is None:
            return ""
        num_id, ilvl = found
        abstract, levels = listed
        if ilvl is None:  # from the style: the level linked to that style, else the first
            ilvl = next((i for i, lv in levels.items() if lv.style == style.style_id), 0)
        if ilvl not in levels:
            return ""
        counters = self.counters.setdefault(abstract, {})
        if num_id not in self.seen:
            self.seen.add(num_id)
            for restart, start in self.nums[num_id].starts.items():
                counters[restart] = start - 1
        counters[ilvl] = min(counters.get(ilvl, levels[ilvl].start - 1) + 1, _MAX_COUNT)
        for deeper in [k for k in counters if k > ilvl]:
            del counters[deeper]  # restarts at its start next time
        level = levels[ilvl]
        if level.fmt == "none":
            return ""
        if level.fmt == "bullet":
            return "• "

        def number(m: re.Match[str]) -> str:
            k = int(m.group(1)) - 1
            at = levels.get(k)
            value = counters.get(k, at.start if at else 1)
            return format_number(value, "decimal" if level.legal or at is None else at.fmt)

        text = re.sub(r"%([1-9])", number, level.text)
        return text + ("" if level.suffix == "nothing" or not text else " ")


def _num_pr(paragraph: Any, style: _Style) -> tuple[str, int | None] | None:
    """(numId, ilvl) of a ``w:p``'s numbering, each from the nearest of the paragraph and its
    styles that sets it (ilvl None: the style's list decides); None where it has none
    (numId 0 switches it off)."""
    num_id, ilvl, own = None, None, False
    for i, pr in enumerate([paragraph.find(qn("w:pPr")), *style.prs]):
        num_pr = None if pr is None else pr.find(qn("w:numPr"))
        if num_pr is None:
            continue
        if ilvl is None:
            ilvl = _val(num_pr, "w:ilvl")
        if num_id is None:
            num_id, own = _val(num_pr, "w:numId"), i == 0
    if num_id is None or num_id == "0":
        return None
    return num_id, _int(ilvl) if ilvl is not None else (0 if own else None)


def _heading_level(paragraph: Any, style: _Style) -> int:
    """1-9 for a heading (the Heading N styles, or an outline level), else 0."""
    for name in style.names:
        m = re.fullmatch(r"heading ([1-9])", name)
        if m is not None:
            return int(m.group(1))
    for pr in [paragraph.find(qn("w:pPr")), *style.prs]:
        level = _val(pr, "w:outlineLvl")
        if level is not None:
            return _int(level) + 1 if _int(level) < 9 else 0  # 9: body text
    return 0


def _is_title(style: _Style) -> bool:
    return "title" in style.names


def _is_toc(style: _Style) -> bool:
    return bool(style.names) and bool(re.fullmatch(r"toc( heading| \d)?", style.names[0]))


_T, _TAB, _BR, _CR = qn("w:t"), qn("w:tab"), qn("w:br"), qn("w:cr")
#: Not shown, or shown twice: properties (their w:tab are tab stops), deleted text, field
#: codes, text boxes (and the fallback copy of drawings that holds them again).
_NOT_TEXT = frozenset({
    qn("w:pPr"), qn("w:rPr"), qn("w:del"), qn("w:instrText"), qn("w:txbxContent"),
    "{http://schemas.openxmlformats.org/markup-compatibility/2006}Fallback",
})  # fmt: skip


def _text(element: Any) -> str:
    """The text a ``w:p`` shows: runs, hyperlinks, insertions, fields' results."""
    parts: list[str] = []

    def walk(parent: Any) -> None:
        for child in parent.iterchildren():
            if child.tag == _T:
                parts.append(child.text or "")
            elif child.tag in (_TAB, _BR, _CR):
                parts.append(" ")
            elif child.tag not in _NOT_TEXT:
                walk(child)

    walk(element)
    return "".join(parts)


def _blocks(container: Any, tags: tuple[str, ...]) -> Iterator[Any]:
    """The children of ``container`` with one of ``tags``, in order, looking into content
    controls (``w:sdt``, ``w:customXml``) but not into a table of contents."""
    for child in container.iterchildren():
        if child.tag in tags:
            yield child
        elif child.tag == qn("w:customXml"):
            yield from _blocks(child, tags)
        elif child.tag == qn("w:sdt"):
            gallery = child.find(f"{qn('w:sdtPr')}/{qn('w:docPartObj')}/{qn('w:docPartGallery')}")
            if gallery is not None and "Table of Contents" in (gallery.get(qn("w:val")) or ""):
                continue
            content = child.find(qn("w:sdtContent"))
            if content is not None:
                yield from _blocks(content, tags)


class _Reader:
    def __init__(self, document: Any) -> None:
        self.styles = _Styles(document)
        self.numbering = _Numbering.of(document, self.styles)

    def paragraph(self, p: Any) -> tuple[_Style, str, str]:
        """(its style, its label, its text); advances the counters even for an empty one."""
        style = self.styles.of(p)
        if _is_toc(style):
            return style, "", ""
        return style, self.numbering.label(p, style), _text(p).strip()

    def table(self, tbl: Any) -> list[str]:
        """A row a line, cells joined by " | "; a cell merged down is read where it begins."""
        lines = []
        for tr in _blocks(tbl, (qn("w:tr"),)):
            cells = []
            for tc in _blocks(tr, (qn("w:tc"),)):
                merge = tc.find(f"{qn('w:tcPr')}/{qn('w:vMerge')}")
                if merge is not None and merge.get(qn("w:val")) != "restart":
                    cells.append("")  # the cell above goes on here
                    continue
                cells.append(" ".join(self.cell(tc)))
            if any(cells):
                lines.append(" | ".join(cells))
        return lines

    def cell(self, tc: Any) -> list[str]:
        out = []
        for block in _blocks(tc, (qn("w:p"), qn("w:tbl"))):
            if block.tag == qn("w:tbl"):
                out.extend(self.table(block))  # a nested table, inline in its cell
            else:
                _, label, text = self.paragraph(block)  # a number alone: a 序号 column
                out.append(re.sub(r"\s+", " ", label + text).strip())
        return [x for x in out if x]


def docx_text(document: Any, check: Callable[[int], None] | None = None) -> str:
    """The text of a python-docx ``Document``: blocks separated by blank lines. ``check``:
    called with the characters so far after each block (it raises to stop a document too
    long to take: ``bounds.check_chars``)."""
    reader = _Reader(document)
    chars = 0
    body = list(_blocks(document.element.body, (qn("w:p"), qn("w:tbl"))))
    # A Title paragraph heads the document: the headings go one level below it.
    below = int(any(_is_title(reader.styles.of(b)) for b in body if b.tag == qn("w:p")))
    out: list[str] = []
    for block in body:
        if block.tag == qn("w:tbl"):
            lines = reader.table(block)
            if lines:
                out.append("\n".join(lines))
                chars += len(out[-1]) + 2
                if check is not None:
                    check(chars)
            continue
        style, label, text = reader.paragraph(block)
        if not text:
            continue
        if _is_title(style):
            level = 1
        else:  # Markdown has six levels
            level = _heading_level(block, style)
            level = min(level + below, 6) if level else 0
        out.append(("#" * level + " " if level else "") + label + text)
        chars += len(out[-1]) + 2
        if check is not None:
            check(chars)
    return "\n\n".join(out) + "\n"
