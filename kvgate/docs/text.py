"""A file's text, the one every chunk's offsets point into.

``.md`` / ``.markdown`` / ``.txt``: the bytes as UTF-8 (a BOM dropped; UTF-16 with its BOM
read too); ``.html`` / ``.htm``: the visible text, headings written as Markdown ``#`` lines
so the chunker sees them, ``<pre>`` fenced as code, a table row a line; ``.pdf``: the text
layer, page by page (pypdf), without its running headers, footers and page numbers;
``.docx``: what Word shows, in order (``docx_text.py``: automatic numbering, tables,
headings as ``#`` lines). What has no text (an empty file, binary bytes under a text name, a
scanned PDF) is refused with the reason.
"""

from __future__ import annotations

import io
import os
import re
from html.parser import HTMLParser

from kvgate.errors import KVGateError

TEXT_SUFFIXES = (".md", ".markdown", ".txt")
SUFFIXES = (*TEXT_SUFFIXES, ".html", ".htm", ".pdf", ".docx")


class UnreadableFile(KVGateError):
    """A file kvgate cannot take the text of (its ``last_error`` in a vector store)."""

    code = "unreadable_file"


def suffix_of(filename: str) -> str:
    return os.path.splitext(filename)[1].lower()


def check_suffix(filename: str) -> None:
    if suffix_of(filename) not in SUFFIXES:
        raise UnreadableFile(
            f"unsupported file type {suffix_of(filename) or '(none)'!r} for {filename!r}; "
            f"supported: {', '.join(SUFFIXES)}"
        )


def extract_text(filename: str, data: bytes) -> str:
    """The file's text (module docstring); raises ``UnreadableFile``."""
    check_suffix(filename)
    if not data:
        raise UnreadableFile(f"{filename!r} is empty")
    suffix = suffix_of(filename)
    if suffix == ".pdf":
        text = _pdf(filename, data)
    elif suffix == ".docx":
        text = _docx(filename, data)
    else:
        text = _decode(filename, data)
        if suffix in (".html", ".htm"):
            text = _html(text)
    if "\x00" in text:
        if suffix not in (".pdf", ".docx"):
            raise UnreadableFile(
                f"{filename!r} is not UTF-8 text (NUL bytes: binary content under a text name?)"
            )
        text = text.replace("\x00", "")  # the embedder reads C strings: a NUL would end one
    if not text.strip():
        raise UnreadableFile(f"{filename!r} has no text")
    return text


def _decode(filename: str, data: bytes) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            pass
    elif b"\x00" not in data[:8192]:
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError:
            pass
    raise UnreadableFile(f"{filename!r} is not UTF-8 text (binary content under a text name?)")


class _HtmlText(HTMLParser):
    _SKIP = frozenset({"script", "style", "head", "template", "noscript"})
    _BLOCK = frozenset({
        "p", "div", "br", "li", "tr", "table", "section", "article", "blockquote",
        "ul", "ol", "dd", "dt", "header", "footer",
    })  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.cells = 0  # cells begun in the current table row

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self.skip += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self.parts.append("\n\n" + "#" * int(tag[1]) + " ")
        elif tag == "pre":  # fenced, so a "# comment" in the code is not a heading
            self.parts.append("\n```\n")
        elif tag in ("td", "th"):  # a row a line, its cells apart
            self.parts.append(" | " if self.cells else "")
            self.cells += 1
        elif tag == "tr":
            self.cells = 0
            self.parts.append("\n")
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag == "pre":
            self.parts.append("\n```\n")
        elif re.fullmatch(r"h[1-6]", tag) or (tag in self._BLOCK and tag != "tr"):
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(data)


def _html(markup: str) -> str:
    parser = _HtmlText()
    parser.feed(markup)
    parser.close()
    text = "".join(parser.parts)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _pdf(filename: str, data: bytes) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PdfReadError, ValueError, KeyError, OSError) as exc:
        raise UnreadableFile(f"{filename!r} is not a readable PDF: {exc}") from None
    if not "".join(pages).strip():
        raise UnreadableFile(
            f"{filename!r} has no text layer (a scanned PDF?); kvgate does not run OCR"
        )
    return "\n\n".join(p.strip() for p in _without_running_lines(pages)) + "\n"


#: A line that is only a page number: "12", "- 12 -", "第 12 页", "第12页 共40页", "12 / 40",
#: "Page 12 of 40". (Not 第12条: that is an article.)
_PAGE_NUMBER = re.compile(
    r"[-—–\s]*(?:\d+|第\s*\d+\s*页(?:\s*[,，/]?\s*共\s*\d+\s*页)?|\d+\s*/\s*\d+"
    r"|(?i:page)\s+\d+(?:\s+of\s+\d+)?)[-—–\s]*"
)
_EDGE = 2  # lines at the top and at the bottom of a page that may be running ones


def _without_running_lines(pages: list[str]) -> list[str]:
    """Each page without the lines a printed document repeats at its edges (the first and
    last ``_EDGE`` lines with text): running headers and footers (``_running``) and page
    numbers. Left in, they split sections and articles mid-text and read as headings ("3
    User Guide" is a numbered heading) on every page."""
    if len(pages) < 2:
        return pages

    def key(line: str) -> str:
        return re.sub(r"\d+", "#", re.sub(r"\s+", " ", line).strip())

    split = [page.splitlines() for page in pages]
    edges = []  # per page: the indices of its first and last _EDGE lines with text
    for lines in split:
        text = [i for i, line in enumerate(lines) if line.strip()]
        edges.append(sorted(set(text[:_EDGE] + text[-_EDGE:])))
    seen: dict[str, dict[int, str]] = {}  # key -> page -> the line
    for page, (lines, at) in enumerate(zip(split, edges, strict=True)):
        for i in at:
            seen.setdefault(key(lines[i]), {})[page] = lines[i].strip()
    running = {k for k, found in seen.items() if _running(found, len(pages))}
    out = []
    for lines, at in zip(split, edges, strict=True):
        drop = {i for i in at if key(lines[i]) in running or _PAGE_NUMBER.fullmatch(lines[i])}
        out.append("\n".join(line for i, line in enumerate(lines) if i not in drop))
    return out


def _running(found: dict[int, str], pages: int) -> bool:
    """Whether a line found at the edge of these pages (page -> its text there) is a running
    one: on at least half of the pages and 3, the same text, or the same but for one number
    that goes up with the page ("Guide 2024 - 7"); not "2 Section 2" on every page."""
    if len(found) < max(3, pages / 2):
        return False
    numbers = [(page, [int(n) for n in re.findall(r"\d+", line)]) for page, line in found.items()]
    if len({len(n) for _, n in numbers}) != 1:
        return False
    varying = 0
    for at in range(len(numbers[0][1])):
        if len({n[at] for _, n in numbers}) == 1:
            continue
        if len({n[at] - page for page, n in numbers}) != 1:
            return False  # a number that is not the page's
        varying += 1
    return varying <= 1


def _docx(filename: str, data: bytes) -> str:
    import zipfile

    import docx

    from kvgate.docs.docx_text import docx_text

    try:
        document = docx.Document(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise UnreadableFile(f"{filename!r} is not a readable .docx: {exc}") from None
    return docx_text(document)
