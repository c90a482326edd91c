"""``rewrite_query``: a question turned into what to search for. The question's framing
(``请问``, ``我想知道``, a closing ``吗？``, the question words ``什么`` / ``如何`` / ``哪些``,
English ``what`` / ``how`` / ``please``) is dropped, and the rest is searched; the search
page's ``search_query`` shows what was searched. A rule, not a model: it costs nothing
and changes no meaning, and a query that would be left empty is searched as it was.
"""

from __future__ import annotations

import re

_OPENING = re.compile(
    r"^\s*(请问一下|请问|我想知道|我想问一下|我想问|想问一下|请告诉我|请教一下|请教)[，,：:\s]*"
)
_CLOSING = re.compile(r"[吗呢吧呀啊么嘛]?[？?！!。.\s]*$")
_CJK_QUESTION = re.compile(
    "是什么|是多少|有哪些|有什么|怎么办|怎么样|怎样|如何|什么|哪些|哪里|多少|是否|能否|可否|怎么|为何"
)
_EN_FRAMING = re.compile(
    r"\b(please|tell me|i want to know|what|which|how|when|where|who|why|whether|does|do|is|"
    r"are|can|could|should|would)\b",
    re.IGNORECASE,
)


def rewrite(query: str) -> str:
    """``query`` without its question framing (see the module); never empty for a
    non-empty query."""
    out = _OPENING.sub("", query)
    out = _CJK_QUESTION.sub(" ", out)
    out = _EN_FRAMING.sub(" ", out)
    out = _CLOSING.sub("", out)
    out = re.sub(r"\s+", " ", out).strip(" ，,：:")
    return out or query.strip()
