"""A file's text, the one every chunk's offsets point into.

``.md`` / ``.markdown`` / ``.txt``: the bytes as UTF-8 (a BOM dropped; UTF-16 with its BOM
read too); ``.html`` / ``.htm``: the visible text, headings written as Markdown ``#`` lines
so the chunker sees them, ``<pre>`` fenced as code, a table row a line; ``.pdf``: the text
layer, page by page (pypdf), without its running headers, footers and page numbers;
``.docx``: what Word shows, in order (``docx_text.py``: automatic numbering, tables,
headings as ``#`` lines). What has no text (an empty file, binary bytes under a text name, a
scanned PDF) is refused with the reason; what passes a limit of ``IngestLimits`` (a zip
inflating too far, too many pages or characters) with ``file_too_complex`` (``bounds.py``).
"""

from __future__ import annotations

import io
import logging
import os
import re
from html.parser import HTMLParser

from kvgate.retrieval.bounds import (
    FileTooComplex,
    IngestLimits,
    UnreadableFile,
    check_chars,
    check_zip,
)
from kvgate.retrieval.chunking import marks_structure

__all__ = ["SUFFIXES", "FileTooComplex", "UnreadableFile", "extract_text"]

log = logging.getLogger("kvgate.retrieval")

TEXT_SUFFIXES = (".md", ".markdown", ".txt")
SUFFIXES = (*TEXT_SUFFIXES, ".html", ".htm", ".pdf", ".docx")


def suffix_of(filename: str) -> str:
    return os.path.splitext(filename)[1].lower()


def check_suffix(filename: str) -> None:
    if suffix_of(filename) not in SUFFIXES:
        raise UnreadableFile(
            f"unsupported file type {suffix_of(filename) or '(none)'!r} for {filename!r}; "
            f"supported: {', '.join(SUFFIXES)}"
        )


def extract_text(filename: str, data: bytes, limits: IngestLimits | None = None) -> str:
    """The file's text (module docstring); raises ``UnreadableFile`` (``FileTooComplex``
    past ``limits``)."""
    limits = limits or IngestLimits()
    check_suffix(filename)
    if not data:
        raise UnreadableFile(f"{filename!r} is empty")
    suffix = suffix_of(filename)
    try:
        if suffix == ".pdf":
            text = _pdf(filename, data, limits)
        elif suffix == ".docx":
            text = _docx(filename, data, limits)
        else:
            text = _decode(filename, data)
            if suffix in (".html", ".htm"):
                text = _html(text)
    except MemoryError:
        raise FileTooComplex(
            f"{filename!r} needs more than the {limits.memory_bytes // 2**20} MiB of memory "
            "ingestion may use"
        ) from None
    check_chars(filename, len(text), limits)
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
    """Visible text; headings as ``#`` lines; ``<pre>`` fenced as code, so a "# comment" in it
    is no heading; a table row a line, its cells joined by " | ", whatever a cell holds
    (paragraphs, line breaks, code, a nested table) kept on that line."""

    _SKIP = frozenset({"script", "style", "head", "template", "noscript"})
    _BLOCK = frozenset({
        "p", "div", "br", "li", "section", "article", "blockquote",
        "ul", "ol", "dd", "dt", "header", "footer", "caption",
    })  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.tables: list[list[int]] = []  # open tables: [cells begun in the row, cell open]
        self.pre = 0  # open <pre> elements
        self.fence_at: int | None = None  # where the open fence goes in parts

    def _in_cell(self) -> bool:
        return any(open_ for _, open_ in self.tables)

    def _break(self, text: str = "\n") -> None:
        self.parts.append(" " if self._in_cell() else text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self.skip += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self._break("\n\n" + "#" * int(tag[1]) + " ")
        elif tag == "pre" and not self.skip:
            self.pre += 1
            if self.pre == 1 and not self._in_cell():
                self.fence_at = len(self.parts)
                self.parts.append("")  # written when it closes (_close_fence)
        elif tag == "table":
            self._break()
            self.tables.append([0, 0])
        elif tag == "tr":
            if self.tables:
                self.tables[-1][:] = [0, 0]
            self._break()
        elif tag in ("td", "th"):
            if not self.tables:
                self.tables.append([0, 0])  # a cell outside any table
            row = self.tables[-1]
            row[1] = 0
            self.parts.append(" | " if row[0] else "")
            row[0], row[1] = row[0] + 1, 1
        elif tag in self._BLOCK:
            self._break()

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag == "pre" and not self.skip:
            if self.pre == 1:
                self._close_fence()
            self.pre = max(0, self.pre - 1)
        elif tag == "table":
            if self.tables:
                self.tables.pop()
            self._break()
        elif tag in ("td", "th"):
            if self.tables:
                self.tables[-1][1] = 0
        elif re.fullmatch(r"h[1-6]", tag) or tag in self._BLOCK:
            self._break()

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(re.sub(r"\s+", " ", data) if self._in_cell() else data)

    def _close_fence(self) -> None:
        """Both fences of the <pre>, longer than any run of backticks in its code."""
        if self.fence_at is None:
            return
        code = "".join(self.parts[self.fence_at + 1 :])
        longest = max((len(run) for run in re.findall(r"`+", code)), default=0)
        fence = "\n" + "`" * max(3, longest + 1) + "\n"
        self.parts[self.fence_at] = fence
        self.parts.append(fence)
        self.fence_at = None

    def close(self) -> None:
        super().close()
        self._close_fence()  # an unclosed <pre> ends with the document


def _html(markup: str) -> str:
    parser = _HtmlText()
    parser.feed(markup)
    parser.close()
    text = "".join(parser.parts)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _pdf(filename: str, data: bytes, limits: IngestLimits) -> str:
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        _check_pages(filename, reader, limits)
        pages, chars = [], 0
        for page in reader.pages:
            pages.append(page.extract_text() or "")
            chars += len(pages[-1])
            check_chars(filename, chars, limits)  # before the next page's work
    except (UnreadableFile, MemoryError):
        raise
    except Exception as exc:  # pypdf raises many kinds on damaged files; the detail is logged
        log.info("%r: pypdf: %s: %s", filename, type(exc).__name__, exc)
        raise UnreadableFile(
            f"{filename!r} is not a readable PDF (damaged, or encrypted?)"
        ) from None
    if not "".join(pages).strip():
        raise UnreadableFile(
            f"{filename!r} has no text layer (a scanned PDF?); kvgate does not run OCR"
        )
    return "\n\n".join(p.strip() for p in _without_running_lines(pages)) + "\n"


_EDGE = 2  # lines at the top and at the bottom of a page that may be running ones


def _without_running_lines(pages: list[str]) -> list[str]:
    """Each page without the lines a printed document repeats at its edges (the first and
    last ``_EDGE`` lines with text): running headers, footers and page numbers
    (``_running``). Left in, they split sections and articles mid-text and read as headings
    ("3 User Guide" is a numbered heading) on every page. Kept: a line the chunker reads as
    structure (附件2, 第三条, Chapter 4 alone atop each page), and the document's first line
    (a title its running header repeats)."""
    if len(pages) < 2:
        return pages

    def key(line: str) -> str:
        return re.sub(r"\d+", "#", re.sub(r"\s+", " ", line).strip())

    split = [page.splitlines() for page in pages]
    edges: list[list[int]] = []  # per page: its first and last _EDGE lines with text
    for lines in split:
        text = [i for i, line in enumerate(lines) if line.strip()]
        at = sorted(set(text[:_EDGE] + text[-_EDGE:]))
        edges.append([i for i in at if not marks_structure(lines[i])])
    seen: dict[str, dict[int, str]] = {}  # key -> page -> the line
    for page, (lines, at) in enumerate(zip(split, edges, strict=True)):
        for i in at:
            seen.setdefault(key(lines[i]), {})[page] = lines[i].strip()
    running = {k for k, found in seen.items() if _running(found, len(pages))}
    first = next((i for i, line in enumerate(split[0]) if line.strip()), None)
    out = []
    for page, (lines, at) in enumerate(zip(split, edges, strict=True)):
        drop = {i for i in at if key(lines[i]) in running}
        if page == 0 and first in drop and len(set(seen[key(lines[first])].values())) == 1:
            drop.discard(first)  # the title, which the running header repeats word for word
        out.append("\n".join(line for i, line in enumerate(lines) if i not in drop))
    return out


def _running(found: dict[int, str], pages: int) -> bool:
    """Whether a line found at the edge of these pages (page -> its text there) is a running
    one: on at least half of the pages and 3, the same text, or the same but for one number
    that goes up with the page ("- 7 -", "第 7 页 共 9 页", "Guide 2024 - 7"); not "2 Section
    2" on every page, nor a number that is not the page's."""
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


def _check_pages(filename: str, reader: object, limits: IngestLimits) -> None:
    """Refuse a PDF of more than ``max_pdf_pages`` pages: first by the count its page tree
    declares (read without walking the tree), then by the pages the tree holds."""
    from pypdf import PdfReader

    assert isinstance(reader, PdfReader)
    try:
        declared = int(reader.trailer["/Root"]["/Pages"]["/Count"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        declared = 0
    if declared > limits.max_pdf_pages or len(reader.pages) > limits.max_pdf_pages:
        raise FileTooComplex(  # (the tree walked only where its count is under the limit)
            f"{filename!r} has more than {limits.max_pdf_pages:,} pages (the limit per PDF)"
        )


def _docx(filename: str, data: bytes, limits: IngestLimits) -> str:
    import docx

    from kvgate.retrieval.docx_text import docx_text

    check_zip(filename, data, limits)  # before python-docx inflates any part
    try:
        document = docx.Document(io.BytesIO(data))
    except MemoryError:
        raise
    except Exception as exc:  # zipfile's, lxml's, python-docx's; the detail is logged
        log.info("%r: python-docx: %s: %s", filename, type(exc).__name__, exc)
        raise UnreadableFile(
            f"{filename!r} is not a readable .docx (damaged, or not a Word document?)"
        ) from None
    return docx_text(document, lambda chars: check_chars(filename, chars, limits))
