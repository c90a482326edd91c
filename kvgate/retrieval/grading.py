"""Grading a Chinese answer against a gold answer as a strict reader would.

Three rules, each applied where the gold answer calls for it:

1. **Verdict.** A gold answer that opens with a verdict (不能, 可以, 不会, 不合法, 不适用, ...)
   needs an answer whose first clause gives the same one: negative or positive (the first
   verdict word in it decides: 不得, 无权, 没有 are negative too).
2. **Quantities.** Every number with its unit in the gold answer must appear in the answer,
   Chinese numerals read as numbers (十五日 = 15日, 百分之三十 = 30%, 五万元 = 50000元,
   双倍 = 2倍) and 天 read as 日.
3. **Wording.** A gold answer with neither must appear in the answer, or its supporting span
   of the article, once punctuation and whitespace are removed from both.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

#: Openings of a verdict, longest first so 不可以 is not read as 可以.
_NEGATIVE = ("不可以", "不应当", "不合法", "不适用", "不需要", "不能", "不会", "不得", "不可",
             "不应", "不行", "无权", "没有", "不用", "无须", "无需", "不是")  # fmt: skip
_POSITIVE = ("可以", "合法", "适用", "需要", "应当", "有权", "能", "会", "是")
_CLAUSE = re.compile(r"[，。；！？,.;!?\n：:（(]")
_PUNCT = re.compile(r"[\s\W_]+", re.UNICODE)

_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6,
           "七": 7, "八": 8, "九": 9}  # fmt: skip
_SMALL = {"十": 10, "百": 100, "千": 1000}
_BIG = {"万": 10_000, "亿": 100_000_000}
_NUMERAL = "零〇一二两三四五六七八九十百千万亿"
#: Units, longest first; each read as its canonical form.
_UNITS = (
    ("个工作日", "工作日"), ("工作日", "工作日"), ("个小时", "小时"), ("小时", "小时"),
    ("个月", "月"), ("月", "月"), ("天", "日"), ("日", "日"), ("周", "周"), ("年", "年"),
    ("万元", "万元"), ("元", "元"), ("%", "%"), ("倍", "倍"),
)  # fmt: skip
_UNIT_RE = "|".join(re.escape(u) for u, _ in _UNITS)
_QUANTITY = re.compile(rf"(百分之)?([0-9０-９]+(?:\.[0-9]+)?|[{_NUMERAL}]+|双)\s*({_UNIT_RE})?")


def chinese_number(text: str) -> int | None:
    """十五 -> 15, 三十六 -> 36, 五百 -> 500, 二十万 -> 200000, 一〇五 -> 105; None if it
    is not a numeral."""
    if not text or any(c not in _NUMERAL for c in text):
        return None
    if all(c in _DIGITS for c in text):  # read digit by digit: 一〇五
        return int("".join(str(_DIGITS[c]) for c in text))
    total = section = digit = 0
    for c in text:
        if c in _DIGITS:
            digit = _DIGITS[c]
        elif c in _SMALL:
            section += (digit or 1) * _SMALL[c]
            digit = 0
        else:  # 万, 亿
            total += (section + digit) * _BIG[c]
            section = digit = 0
    return total + section + digit


@dataclass(frozen=True)
class Quantity:
    value: float
    unit: str  # canonical: 日, 月, 年, 小时, 周, 工作日, 元, %, 倍

    def __str__(self) -> str:
        return f"{self.value:g}{self.unit}"


def quantities(text: str) -> list[Quantity]:
    """The numbers with units in ``text``, normalized (numbers without a unit are left out:
    a gold "第四十二条" or "每月" carries none)."""
    text = unicodedata.normalize("NFKC", text)
    found: list[Quantity] = []
    canonical = dict(_UNITS)
    for m in _QUANTITY.finditer(text):
        percent, number, unit = m.group(1), m.group(2), m.group(3)
        if number == "双":
            value: float | None = 2.0 if unit == "倍" else None
        elif number[0].isdigit():
            value = float(number)
        else:
            n = chinese_number(number)
            value = None if n is None else float(n)
        if value is None:
            continue
        start = m.start()
        if start and text[start - 1] in "第每":  # an ordinal (第十五日) or a rate (每月)
            continue
        if percent:
            found.append(Quantity(value, "%"))
            continue
        if unit is None:
            continue
        unit = canonical[unit]
        if unit == "万元":
            value, unit = value * 10_000, "元"
        found.append(Quantity(value, unit))
    return found


def _first_clause(text: str) -> str:
    text = text.strip().lstrip('*#> \t「“"')
    return _CLAUSE.split(text, maxsplit=1)[0]


def verdict(text: str) -> bool | None:
    """The verdict ``text`` opens with: False (negative), True (positive), None (none)."""
    clause = _first_clause(text)
    for i in range(len(clause)):
        if clause.startswith(_NEGATIVE, i):
            return False
        if clause.startswith(_POSITIVE, i):
            return True
    return None


#: The words a gold answer's verdict opens with. 不得 is one only where its clause states no
#: quantity: 不得约定试用期 is a verdict, 不得超过二个月 a limit (its number is what counts).
_VERDICTS = (("不可以", False), ("不合法", False), ("不适用", False), ("不能", False),
             ("不会", False), ("可以", True), ("合法", True), ("适用", True), ("能", True),
             ("会", True))  # fmt: skip


def opens_with_verdict(gold: str) -> bool | None:
    """The verdict a gold answer opens with, else None."""
    clause = _first_clause(gold)
    for word, positive in _VERDICTS:
        if clause.startswith(word):
            return positive
    if clause.startswith("不得") and not quantities(clause):
        return False
    return None


def normalize(text: str) -> str:
    """Without punctuation or whitespace, full-width forms folded, 天 read as 日."""
    return _PUNCT.sub("", unicodedata.normalize("NFKC", text)).replace("天", "日")


@dataclass(frozen=True)
class Grade:
    correct: bool
    #: Which rules applied and what failed, for the report.
    rules: tuple[str, ...]
    missing: tuple[str, ...] = ()


def grade(answer: str, gold: str, span: str = "") -> Grade:
    """Is ``answer`` right against the gold short answer ``gold`` (and its article's
    supporting ``span``)?"""
    rules: list[str] = []
    missing: list[str] = []
    expected = opens_with_verdict(gold)
    if expected is not None:
        rules.append("verdict")
        if verdict(answer) is not expected:
            missing.append("verdict " + ("positive" if expected else "negative"))
    wanted = quantities(gold)
    if wanted:
        rules.append("quantities")
        have = set(quantities(answer))
        missing += [str(q) for q in wanted if q not in have]
    if not rules:
        rules.append("wording")
        text = normalize(answer)
        if normalize(gold) not in text and not (span and normalize(span) in text):
            missing.append("wording")
    return Grade(not missing, tuple(rules), tuple(missing))


def holds_article(text: str, article: str, evidence: str) -> bool:
    """Does a retrieved or cited passage hold the gold article: a line opening with its
    heading (``第十九条``; a mention inside a sentence is not one), or most of its text (a
    static window that holds the article's middle without its heading)?"""
    if re.search(rf"(?m)^\W*{re.escape(article)}(?!\w*条)", text):
        return True
    body = re.sub(r"\s+", "", evidence)
    probe = body[len(article) : len(article) + 40]
    return len(probe) >= 20 and probe in re.sub(r"\s+", "", text)
