"""A file's text, the one every chunk's offsets point into.

``.md`` / ``.markdown`` / ``.txt``: the bytes as UTF-8 (a BOM dropped; UTF-16 with its BOM
read too); ``.html`` / ``.htm``: the visible text, headings written as Markdown ``#`` lines
so the chunker sees them; ``.pdf``: the text layer, page by page (pypdf); ``.docx``: the
paragraphs in order, Word's Heading styles as ``#`` lines (python-docx). What has no text
(an empty file, binary bytes under a text name, a scanned PDF) is refused with the reason.
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
        "p", "div", "br", "li", "tr", "table", "section", "article", "pre", "blockquote",
        "ul", "ol", "dd", "dt", "header", "footer",
    })  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self.skip += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self.parts.append("\n\n" + "#" * int(tag[1]) + " ")
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
        elif re.fullmatch(r"h[1-6]", tag) or tag in self._BLOCK:
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
    return "\n\n".join(p.strip() for p in pages) + "\n"


def _docx(filename: str, data: bytes) -> str:
    import zipfile

    import docx

    try:
        document = docx.Document(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise UnreadableFile(f"{filename!r} is not a readable .docx: {exc}") from None
    lines = []
    for paragraph in document.paragraphs:
        text = paragraph.text.strip()
        if not text:
            continue
        style = (paragraph.style.name if paragraph.style is not None else "") or ""
        m = re.fullmatch(r"Heading (\d)", style)
        lines.append(("#" * int(m.group(1)) + " " + text) if m else text)
    return "\n\n".join(lines) + "\n"
