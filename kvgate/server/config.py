"""Server settings, and the config file that can hold them (and every engine knob).

The config file (TOML, or YAML by extension) uses the command-line flags' names, with dashes
or underscores: ``port = 8080``, ``kv-cache-memory = "2GiB"``, ``no-prefix-caching = true``.
Flags given on the command line win over the file.

Several models go in a ``models`` list of tables, each with its ``model``, and optionally
``name`` (the served name), ``kv_weight`` (its part of ``kv-cache-memory``) and engine
settings of its own (``dtype``, ``max_model_len``, ``max_num_seqs``, ...)::

    kv-cache-memory = "2GiB"
    [[models]]
    model = "smollm2"
    kv_weight = 3
    [[models]]
    model = "gemma3-270m"
    dtype = "float32"
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from kvgate.errors import InvalidConfig
from kvgate.retrieval.bounds import IngestLimits
from kvgate.server.limits import RequestLimits
from kvgate.settings_file import read_table

#: ``--embed-precision``: ``auto`` or one of the encoder's (kvgate/retrieval/e5_encoder.py).
EMBED_PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: The name clients put in ``model``; defaults to the engine's ``model`` argument.
    served_model_name: str = "smollm2"
    api_keys_file: str | None = None
    #: The tenants file (keys, priorities, quotas, limits); see governance/tenants.py.
    tenants_file: str | None = None
    #: "fair": tenant-aware scheduling (priority, fair share, quotas); "fifo": arrival order.
    scheduling: str = "fair"
    #: Requests that may wait beyond the running batch before new ones get 503.
    max_queue_len: int = 256
    #: Where the JSON-lines access log goes: a file path, "-" for stderr, "" for nowhere.
    access_log: str = "-"
    log_level: str = "info"
    #: Keys (plain, or ``sha256:<hex>``) that may read per-tenant /metrics and /dashboard
    #: figures, besides the tenants file's ``metrics_keys`` and ``admin_keys``.
    metrics_keys: tuple[str, ...] = ()
    #: The usage ledger's SQLite file (None: $KVGATE_USAGE_DB, else
    #: ~/.local/state/kvgate/usage.sqlite3); see governance/usage.py.
    usage_db: str | None = None
    #: Where files, vector stores and their indexes live (None: $KVGATE_DATA_DIR, else
    #: ~/.local/share/kvgate); see kvgate/retrieval.
    data_dir: str | None = None
    #: Refuse to start when ``data_dir`` (or the usage ledger's folder) may be read by other
    #: users; else a warning (kvgate/launch/server.py).
    strict_data_dir: bool = False
    #: The documents database (None: $KVGATE_DOCS_URL, else SQLite in ``data_dir``): a
    #: ``postgresql://`` URL shares files and vector stores between replicas.
    docs_url: str | None = None
    #: Seconds a stored response (``/v1/responses``) is kept; OpenAI keeps them 30 days.
    responses_retention: float = 30 * 24 * 3600.0
    #: The priority class document ingestion runs at (its process's OS priority).
    ingest_priority: str = "batch"
    #: What one file's ingestion may take (time, memory, pages, characters); docs/bounds.py.
    ingest_limits: IngestLimits = field(default_factory=IngestLimits)
    #: The document embedder's arithmetic: auto, float32 or bfloat16 (docs/e5_encoder.py).
    embed_precision: str = "auto"  # one of EMBED_PRECISIONS
    #: What one request may make the server do (body size, prompt size, stop lists, read
    #: timeouts, connections); see server/limits.py.
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: Seconds a stopping server gives its requests in flight (SIGTERM: see ``run_server``).
    shutdown_timeout: float = 30.0
    #: With replicas: ``open`` or ``closed`` when the shared rate state is unreachable.
    rates_unreachable: str = "open"
    #: The engine in a process of its own, not a thread of the server's.
    engine_process: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidConfig(f"port must be in [0, 65535], got {self.port}", param="port")
        if self.max_queue_len < 0:
            raise InvalidConfig(
                f"max_queue_len must be >= 0, got {self.max_queue_len}", param="max_queue_len"
            )
        if self.scheduling not in ("fair", "fifo"):
            raise InvalidConfig(
                f"scheduling must be 'fair' or 'fifo', got {self.scheduling!r}", param="scheduling"
            )
        if self.tenants_file is not None and self.api_keys_file is not None:
            raise InvalidConfig(
                "give --tenants or --api-keys-file, not both (the tenants file holds the keys)",
                param="tenants_file",
            )
        if self.ingest_priority not in ("critical", "standard", "batch"):
            raise InvalidConfig(
                "ingest_priority must be critical, standard or batch", param="ingest_priority"
            )
        if self.embed_precision not in EMBED_PRECISIONS:
            raise InvalidConfig(
                f"embed_precision must be one of {', '.join(EMBED_PRECISIONS)}",
                param="embed_precision",
            )
        if not self.responses_retention > 0:
            raise InvalidConfig(
                "responses_retention must be a positive number of seconds",
                param="responses_retention",
            )
        if not self.served_model_name:
            raise InvalidConfig("served_model_name must not be empty", param="served_model_name")


def read_config_file(path: str) -> dict[str, Any]:
    return read_table(path, what="config file", param="config")


def config_file_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The file's settings as command-line arguments, so argparse checks their types and
    names exactly as it checks flags; put them before the real flags, which then win."""
    actions = {
        opt.lstrip("-"): action
        for action in parser._actions  # argparse has no public listing of its options
        for opt in action.option_strings
        if opt.startswith("--")
    }
    argv: list[str] = []
    for key, value in read_config_file(path).items():
        name = str(key).replace("_", "-")
        if name == "models":
            continue  # see config_file_models
        action = actions.get(name)
        if action is None or name in ("config", "help"):
            known = ", ".join(sorted(k for k in actions if k not in ("config", "help")))
            raise InvalidConfig(
                f"config file {os.fspath(path)!r}: unknown setting {key!r}; known: {known}",
                param="config",
            )
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise InvalidConfig(
                    f"config file {path!r}: {key!r} must be true or false", param="config"
                )
            if value:
                argv.append(f"--{name}")
        elif isinstance(value, (dict, list)) or value is None:
            raise InvalidConfig(
                f"config file {path!r}: {key!r} must be a single value", param="config"
            )
        else:
            argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def config_file_models(path: str) -> list[dict[str, Any]]:
    """The file's ``models`` list (empty without one); each entry a table with ``model``."""
    raw = read_config_file(path).get("models")
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise InvalidConfig(
            f"config file {path!r}: 'models' must be a non-empty list of tables, each with "
            "its 'model'",
            param="models",
        )
    return [dict(m) for m in raw]
