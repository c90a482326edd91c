"""A Word document's text (.docx) as the chunker reads it: what Word shows, in order.

python-docx gives a paragraph's runs; three things a reader sees are not in them:

- **Automatic numbering** (``numbering.xml``): the label Word draws before a numbered
  paragraph, e.g. ``第一条`` (``lvlText`` "第%1条", ``chineseCounting``), ``1.2`` ("%1.%2"),
  ``（一）``. Chinese contracts and regulations drafted in Word number their articles this
  way; without the label the chunker finds no 第X条 and a citation names no article.
  Counters run per list (``abstractNum``, which the ``num`` instances of one list share);
  a level's advance restarts the levels below it; a ``num``'s ``startOverride`` restarts its
  level where that ``num`` is first used. Numbering may come from the paragraph or from its
  style (numbered headings).
- **Tables**, which ``Document.paragraphs`` leaves out: a row a line, its cells joined by
  `` | `` (a merged cell once), in their place between the paragraphs.
- **Headings**: the Heading N styles, or a paragraph's outline level, as Markdown ``#``
  lines; a Title paragraph as ``#``, with the headings then one level below it.

Skipped: a table of contents (its ``TOC N`` lines would read as a second copy of every
heading and article), headers, footers, footnotes and text boxes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from docx.oxml.ns import qn
from docx.table import Table
from docx.text.paragraph import Paragraph

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


def _int(value: str | None) -> int:
    """An integer attribute; 0 where it is absent or not a number (a damaged file's lists
    are then numbered from 0, not refused)."""
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def _val(element: Any, tag: str) -> str | None:
    """The ``w:val`` of ``element``'s child ``tag``, or None."""
    child = None if element is None else element.find(qn(tag))
    return None if child is None else child.get(qn("w:val"))


@dataclass(frozen=True)
class _Level:
    start: int
    fmt: str
    text: str  # w:lvlText, "%1" .. "%9" standing for the levels' numbers
    suffix: str  # after the label: w:suff tab (drawn as a space), space or nothing
    legal: bool  # w:isLgl: every level's number in decimal
    style: str | None  # w:pStyle: the paragraph style this level belongs to


@dataclass
class _Numbering:
    """numbering.xml's lists, and the counters as the body is read in order."""

    levels: dict[str, dict[int, _Level]] = field(default_factory=dict)  # abstractNumId ->
    nums: dict[str, tuple[str, dict[int, int]]] = field(default_factory=dict)  # numId ->
    counters: dict[str, dict[int, int]] = field(default_factory=dict)  # abstractNumId ->
    seen: set[str] = field(default_factory=set)  # numIds whose start overrides are applied

    @classmethod
    def of(cls, document: Any) -> _Numbering:
        try:
            root = document.part.numbering_part.element
        except (NotImplementedError, KeyError):
            return cls()  # no numbering part
        out = cls()
        for abstract in root.findall(qn("w:abstractNum")):
            levels: dict[int, _Level] = {}
            for lvl in abstract.findall(qn("w:lvl")):
                levels[_int(lvl.get(qn("w:ilvl")))] = _Level(
                    start=_int(_val(lvl, "w:start")),
                    fmt=_val(lvl, "w:numFmt") or "decimal",
                    text=_val(lvl, "w:lvlText") or "",
                    suffix=_val(lvl, "w:suff") or "tab",
                    legal=lvl.find(qn("w:isLgl")) is not None,
                    style=_val(lvl, "w:pStyle"),
                )
            out.levels[abstract.get(qn("w:abstractNumId"))] = levels
        for num in root.findall(qn("w:num")):
            overrides: dict[int, int] = {}
            for override in num.findall(qn("w:lvlOverride")):
                start = _val(override, "w:startOverride")
                if start is not None:
                    overrides[_int(override.get(qn("w:ilvl")))] = _int(start)
            out.nums[num.get(qn("w:numId"))] = (_val(num, "w:abstractNumId") or "", overrides)
        return out

    def label(self, paragraph: Paragraph) -> str:
        """The number Word draws before ``paragraph`` (with its separator), or ""; advances
        the counters: call once per paragraph, in document order."""
        found = _num_pr(paragraph)
        if found is None or found[0] not in self.nums:
            return ""
        num_id, ilvl = found
        abstract, overrides = self.nums[num_id]
        levels = self.levels.get(abstract, {})
        if ilvl is None:  # from the style: the level linked to that style, else the first
            style = paragraph.style.style_id if paragraph.style is not None else None
            ilvl = next((i for i, lv in levels.items() if lv.style and lv.style == style), 0)
        if ilvl not in levels:
            return ""
        counters = self.counters.setdefault(abstract, {})
        if num_id not in self.seen:
            self.seen.add(num_id)
            for restart, start in overrides.items():
                counters[restart] = start - 1
        counters[ilvl] = counters.get(ilvl, levels[ilvl].start - 1) + 1
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


def _num_pr(paragraph: Paragraph) -> tuple[str, int | None] | None:
    """(numId, ilvl) of the paragraph's numbering, its own or its style's (ilvl None: the
    style's list decides); None where it has none (numId 0 switches it off)."""
    prs = [paragraph._p.pPr, *(s.element.pPr for s in _styles(paragraph))]
    for i, pr in enumerate(prs):
        num_pr = None if pr is None else pr.find(qn("w:numPr"))
        num_id = _val(num_pr, "w:numId")
        if num_id is None:
            continue
        if num_id == "0":
            return None
        ilvl = _val(num_pr, "w:ilvl")
        return num_id, _int(ilvl) if ilvl is not None else (0 if i == 0 else None)
    return None


def _styles(paragraph: Paragraph) -> Iterator[Any]:
    """The paragraph's style and the ones it is based on, nearest first."""
    style = paragraph.style
    for _ in range(16):  # a cycle of basedOn would otherwise never end
        if style is None:
            return
        yield style
        style = style.base_style


def _is_title(paragraph: Paragraph) -> bool:
    return any(style.name == "Title" for style in _styles(paragraph))


def _heading_level(paragraph: Paragraph) -> int:
    """1-9 for a heading (the Heading N styles, or an outline level), else 0."""
    for style in _styles(paragraph):
        m = re.fullmatch(r"Heading ([1-9])", style.name or "")
        if m is not None:
            return int(m.group(1))
    for pr in [paragraph._p.pPr, *(s.element.pPr for s in _styles(paragraph))]:
        level = _val(pr, "w:outlineLvl")
        if level is not None:
            return _int(level) + 1 if 0 <= _int(level) < 9 else 0  # 9: body text
    return 0


def _is_toc(paragraph: Paragraph) -> bool:
    name = paragraph.style.name if paragraph.style is not None else ""
    return bool(re.fullmatch(r"(?i)toc( heading| \d)?", name or ""))


def _blocks(parent: Any, container: Any) -> Iterator[Paragraph | Table]:
    """Paragraphs and tables of a body in order, into content controls (``w:sdt``) but not
    into a table of contents."""
    for child in container.iterchildren():
        if child.tag == qn("w:p"):
            yield Paragraph(child, parent)
        elif child.tag == qn("w:tbl"):
            yield Table(child, parent)
        elif child.tag == qn("w:sdt"):
            gallery = child.find(f"{qn('w:sdtPr')}/{qn('w:docPartObj')}/{qn('w:docPartGallery')}")
            if gallery is not None and "Table of Contents" in (gallery.get(qn("w:val")) or ""):
                continue
            content = child.find(qn("w:sdtContent"))
            if content is not None:
                yield from _blocks(parent, content)


def _table_lines(table: Table) -> list[str]:
    lines = []
    for row in table.rows:
        cells: list[str] = []
        last = None
        for cell in row.cells:
            if cell._tc is last:
                continue  # a merged cell python-docx repeats
            last = cell._tc
            cells.append(re.sub(r"\s+", " ", cell.text).strip())
        if any(cells):
            lines.append(" | ".join(cells))
    return lines


def docx_text(document: Any) -> str:
    """The text of a python-docx ``Document``: blocks separated by blank lines."""
    numbering = _Numbering.of(document)
    blocks = list(_blocks(document._body, document.element.body))
    # A Title paragraph heads the document: the headings go one level below it.
    below = 1 if any(isinstance(b, Paragraph) and _is_title(b) for b in blocks) else 0
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Table):
            lines = _table_lines(block)
            if lines:
                out.append("\n".join(lines))
            continue
        if _is_toc(block):
            continue
        label = numbering.label(block)  # advances the counters even for an empty paragraph
        text = block.text.strip()
        if not text:
            continue
        level = 1 if _is_title(block) else _heading_level(block)
        level += below if level and not _is_title(block) else 0
        out.append(("#" * level + " " if level else "") + label + text)
    return "\n\n".join(out) + "\n"
