"""Files that cost far more to read than to send, built cheaply: the audit's probes in small.

- ``docx_bomb``: a valid .docx whose ``word/document.xml`` inflates to ``inflated`` bytes
  (spaces inside one ``w:t``) from about a thousandth of that: one raw-deflate block of
  1 MiB of spaces, written again and again (each block starts from a fresh dictionary, so
  repeats are a valid stream), in a zip written by hand. No gigabyte is ever held or
  compressed here.
- ``pdf_of_pages``: a PDF whose page tree holds ``pages`` references to one shared page.
- ``long_docx``: a .docx of ``chars`` characters of varied CJK text (it deflates little, as
  real text does, so only the character limit stops it).
"""

from __future__ import annotations

import io
import struct
import zlib

_BLOCK = 1 << 20


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH)


def _zip(members: list[tuple[str, bytes, int, int]]) -> bytes:
    """A zip of (name, raw deflate data, crc32, inflated size) members (sizes < 4 GiB)."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, data, crc, size in members:
        offset = out.tell()
        raw = name.encode()
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc,
                              len(data), size, len(raw), 0) + raw + data)  # fmt: skip
        central.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21,
                                  crc, len(data), size, len(raw), 0, 0, 0, 0, 0,
                                  offset) + raw)  # fmt: skip
    start, directory = out.tell(), central.getvalue()
    out.write(directory)
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members),
                          len(directory), start, 0))  # fmt: skip
    return out.getvalue()


def _member(name: str, data: bytes) -> tuple[str, bytes, int, int]:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return name, c.compress(data) + c.flush(), zlib.crc32(data), len(data)


def _minimal_docx_parts() -> dict[str, bytes]:
    import zipfile

    import docx

    buf = io.BytesIO()
    docx.Document().save(buf)
    with zipfile.ZipFile(buf) as z:
        return {name: z.read(name) for name in z.namelist()}


def docx_bomb(inflated: int) -> bytes:
    parts = _minimal_docx_parts()
    head = (
        b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
        b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
        b"<w:body><w:p><w:r><w:t>"
    )
    tail = b"</w:t></w:r></w:p></w:body></w:document>"
    blocks = max(1, (inflated - len(head) - len(tail)) // _BLOCK)
    spaces = b" " * _BLOCK
    crc = zlib.crc32(head)
    for _ in range(blocks):
        crc = zlib.crc32(spaces, crc)
    crc = zlib.crc32(tail, crc)
    last = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = _raw_deflate(head) + _raw_deflate(spaces) * blocks + last.compress(tail) + last.flush()
    size = len(head) + blocks * _BLOCK + len(tail)
    members = [_member(n, b) for n, b in parts.items() if n != "word/document.xml"]
    members.append(("word/document.xml", data, crc, size))
    return _zip(members)


def pdf_of_pages(pages: int, text: str = "Page") -> bytes:
    content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    kids = b" ".join(b"3 0 R" for _ in range(pages))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + kids + b"] /Count " + str(pages).encode() + b" >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length " + str(len(content)).encode() + b" >>\nstream\n" + content
        + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]  # fmt: skip
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(f"{i} 0 obj\n".encode() + body + b"\nendobj\n")
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        out.write(f"{offset:010d} 00000 n \n".encode())
    out.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\n".encode())
    out.write(f"startxref\n{xref}\n%%EOF\n".encode())
    return out.getvalue()


def long_docx(chars: int, seed: int = 0) -> bytes:
    """Paragraphs of 10,000 random characters of the first 3,000 CJK ideographs."""
    import zipfile

    import numpy as np

    codes = np.random.default_rng(seed).integers(0x4E00, 0x4E00 + 3000, chars, dtype=np.uint32)
    text = codes.tobytes().decode("utf-32-le")
    per = 10_000
    body = "".join(
        f"<w:p><w:r><w:t>{text[i : i + per]}</w:t></w:r></w:p>" for i in range(0, chars, per)
    )
    parts = _minimal_docx_parts()
    parts["word/document.xml"] = (
        '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
        '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
        f"<w:body>{body}</w:body></w:document>"
    ).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, data in parts.items():
            z.writestr(name, data)
    return buf.getvalue()
