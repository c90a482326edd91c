"""What ``kvgate serve`` is asked to serve: its flags, the config file under them, and the
settings they make (the models, each with its engine configuration, and the server's).

One place turns arguments into a :class:`Launch`; the CLI (``kvgate serve``), the Ray
replicas (``kvgate.cluster``) and anything else that starts a server read it from here, and
:mod:`kvgate.launch.server` builds and runs the server from a ``Launch``. ``--model`` may be
given several times (or the config file may hold a ``models`` list): each model gets an
engine and a KV pool of its own, the pools sized from the one ``--kv-cache-memory`` budget
split by ``--kv-weight``; requests go to the model they name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.config import (
    DEFAULT_MODEL,
    GGUF_BLOCKS,
    KV_CACHE_DTYPES,
    KV_TIERS,
    SPECULATIVE_METHODS,
    EngineConfig,
    available_memory_bytes,
    parse_memory,
)
from kvgate.errors import InvalidConfig
from kvgate.model import cpu_isa
from kvgate.retrieval.bounds import IngestLimits, MiB
from kvgate.server.config import (
    EMBED_PRECISIONS,
    ServerConfig,
    config_file_argv,
    config_file_models,
)
from kvgate.server.limits import RequestLimits


def add_engine_args(p: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    g = p.add_argument_group("engine")
    if several_models:
        g.add_argument(
            "--model",
            action="append",
            default=None,
            help="'smollm2' (default), 'gemma3-270m', 'qwen2.5-coder-1.5b', a .gguf file, or a "
            "HF checkpoint directory; repeat it to serve several models, each with its own engine",
        )
    else:
        g.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help="'smollm2' (default), 'gemma3-270m', 'qwen2.5-coder-1.5b', a .gguf file, or a "
            "HF checkpoint directory",
        )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto (default): bfloat16 where this CPU has a native bf16 linear, else float32",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8-b32"],
        help="int8 linear layers, about half of bf16's bytes per token: the weights made "
        "Q8_0 blocks at load (a scale per 32 inputs) on the W8A8 block kernels, x quantized "
        "to int8 per 32 inputs; int8-b32 is a synonym",
    )
    g.add_argument(
        "--gguf-blocks",
        default="auto",
        choices=list(GGUF_BLOCKS),
        help="a GGUF's quantized matrices: auto (default) multiplies them in their blocks "
        "natively with --dtype auto where that gains on this CPU (models of >= 1 GiB in "
        "bf16; every model with AVX512-VNNI and no AMX), native always, dequantize never",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="how K/V are stored: auto (default) as the model computes them; int8 or fp8 "
        "(e4m3) with a float32 scale per 32 values (per token and KV head), about 1.8x the "
        "tokens in the same pool (keys less a per-channel offset where the model has a key "
        "bias: kv_codec.key_offset); bfloat16 or float32 cast",
    )
    g.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV pool size, e.g. 2GiB, or a fraction of available memory (0.2)",
    )
    g.add_argument(
        "--kv-tier",
        default="none",
        choices=list(KV_TIERS),
        help="a second KV tier: disk keeps every full block the pool caches in files (also "
        "across restarts), and a prefix the pool lost is loaded back instead of recomputed",
    )
    g.add_argument("--kv-tier-size", default="4GiB", help="the disk tier's size limit, e.g. 8GiB")
    g.add_argument(
        "--kv-tier-dir",
        default=None,
        help="the disk tier's folder (default: kv-tier in --data-dir, else in "
        "$KVGATE_DATA_DIR or ~/.local/share/kvgate)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--max-num-seqs", type=int, default=128, help="sequences that may run in one step"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per step (decodes and prefill chunks together): the step's budget",
    )
    g.add_argument(
        "--num-spare-seqs",
        type=int,
        default=None,
        help="sequences that may run beyond --max-num-seqs, only for requests that would "
        "otherwise preempt running work for a slot (a higher class, a tenant taking back its "
        "guarantee); default max-num-seqs/8, at least 1; 0: they preempt",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt plus output tokens (default: the model's own)",
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="never reuse the KV of a cached prefix"
    )
    g.add_argument(
        "--threads", type=int, default=None, help="the model's CPU threads (default: PyTorch's)"
    )
    g.add_argument(
        "--no-native-kernels",
        action="store_true",
        help="stay on PyTorch ops (no C kernels built at first use)",
    )
    g.add_argument(
        "--speculative",
        default=None,
        choices=list(SPECULATIVE_METHODS),
        help="speculative decoding: ngram drafts tokens by looking the last few up in the "
        "request's own prompt and output, and the model verifies them in one step (exact: "
        "the same tokens as without it); a request opts out with speculative: false",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="most draft tokens verified per request and step",
    )
    g.add_argument(
        "--speculative-ngram-min",
        type=int,
        default=2,
        help="shortest n-gram of the request's last tokens looked up (longest first)",
    )
    g.add_argument(
        "--speculative-ngram-max",
        type=int,
        default=4,
        help="longest n-gram of the request's last tokens looked up",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve on the first model from the start, "
        'each checked against it now; a request selects one with "model": NAME, and '
        "admins load more with POST /v1/load_lora_adapter",
    )
    g.add_argument(
        "--max-lora-memory",
        default="256MiB",
        help="bytes of LoRA adapters kept loaded (float32 factors); past it the least "
        "recently used adapter no request uses is dropped and read again on next use",
    )


def lora_modules(values: Sequence[str] | None) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` NAME=PATH values as (name, path) pairs; a clear error for others."""
    pairs = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise InvalidConfig(
                f"--lora-modules takes NAME=PATH, got {value!r}", param="lora_modules"
            )
        pairs.append((name, path))
    return tuple(pairs)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    # A KVGATE_CPU_ISA above this CPU: a clear error now, naming the missing flags.
    cpu_isa.default_level()
    kv: str | float = a.kv_cache_memory
    model = a.model if isinstance(a.model, str) else (a.model or [DEFAULT_MODEL])[0]
    return EngineConfig(
        model=model,
        dtype=a.dtype,
        quantization=a.quantization,
        gguf_blocks=a.gguf_blocks,
        kv_cache_dtype=a.kv_cache_dtype,
        kv_cache_memory=kv,
        kv_tier=a.kv_tier,
        kv_tier_size=a.kv_tier_size,
        kv_tier_dir=a.kv_tier_dir
        or (os.path.join(a.data_dir, "kv-tier") if getattr(a, "data_dir", None) else None),
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        num_spare_seqs=a.num_spare_seqs,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        num_threads=a.threads,
        native_kernels=not a.no_native_kernels,
        speculative=a.speculative,
        num_speculative_tokens=a.num_speculative_tokens,
        speculative_ngram_min=a.speculative_ngram_min,
        speculative_ngram_max=a.speculative_ngram_max,
        lora_modules=lora_modules(getattr(a, "lora_modules", None)),
        max_lora_memory=getattr(a, "max_lora_memory", "256MiB"),
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None, help="TOML or YAML file with any of these settings")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="the name clients send (default: --model's name); once per --model, in order",
    )
    g.add_argument(
        "--kv-weight",
        action="append",
        type=float,
        default=None,
        help="with several --model: each one's part of --kv-cache-memory, in order "
        "(default: equal parts)",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        help="file of 'KEY [TENANT]' lines; when given, every API call needs a key",
    )
    g.add_argument(
        "--tenants",
        default=None,
        help="tenants file (TOML/YAML): keys, priorities, KV quotas, rate limits; "
        "re-read on SIGHUP or POST /admin/reload",
    )
    g.add_argument(
        "--metrics-key",
        action="append",
        default=[],
        help="a key (or sha256:<hex>) that may read per-tenant /metrics and /dashboard figures "
        "(repeatable; the tenants file's metrics_keys and admin_keys may too); without one, "
        "callers see aggregates only",
    )
    g.add_argument(
        "--scheduling",
        default="fair",
        choices=["fair", "fifo"],
        help="fair: tenant priorities, fair shares and quotas; fifo: arrival order",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=256,
        help="requests that may wait beyond --max-num-seqs before new ones get 503",
    )
    g.add_argument(
        "--usage-db",
        default=None,
        help="the usage ledger's SQLite file (default: $KVGATE_USAGE_DB, else "
        "~/.local/state/kvgate/usage.sqlite3); read it with GET /admin/usage",
    )
    g.add_argument(
        "--access-log", default="-", help="JSON-lines access log: a file, '-' stderr, '' off"
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="where uploaded files, vector stores and their indexes live (default: "
        "$KVGATE_DATA_DIR, else ~/.local/share/kvgate)",
    )
    g.add_argument(
        "--strict-data-dir",
        action="store_true",
        help="refuse to start when --data-dir or the usage ledger's folder may be read by "
        "other users (default: a warning); kvgate makes its own folders 0700, files 0600",
    )
    g.add_argument(
        "--docs-url",
        default=None,
        help="the documents database: postgresql://user@host/db to share files and vector "
        "stores between replicas (default: $KVGATE_DOCS_URL, else SQLite in --data-dir)",
    )
    g.add_argument(
        "--responses-retention",
        type=float,
        default=30 * 24 * 3600.0,
        metavar="SECONDS",
        help="how long stored responses (/v1/responses with store) are kept "
        "(default: 30 days, as OpenAI's); a tenant's max_stored_responses caps their number",
    )
    g.add_argument(
        "--ingest-priority",
        default="batch",
        choices=["critical", "standard", "batch"],
        help="the priority class of document ingestion (its process's OS priority)",
    )
    add_ingest_limit_args(p)
    g.add_argument(
        "--embed-precision",
        default="auto",
        choices=list(EMBED_PRECISIONS),
        help="the document embedder's arithmetic (auto: bfloat16 where oneDNN has bf16 GEMMs, "
        "else float32; logged at start)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's log level (stderr)",
    )
    c = p.add_argument_group("replicas (Ray Serve: kvgate.cluster)")
    c.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas behind one ingress on a local Ray (prefix-cache "
        "affinity routing, the tenants' rates shared by all)",
    )
    c.add_argument(
        "--rates-unreachable",
        default="open",
        choices=["open", "closed"],
        help="with --replicas, when the shared rate state cannot be reached: open (each "
        "replica limits alone) or closed (rate-limited tenants get 503)",
    )
    c.add_argument(
        "--engine-process",
        default=os.environ.get("KVGATE_ENGINE_PROCESS", "off"),
        choices=["on", "off"],
        help="on: the engine (model, scheduler) runs in a process of its own, the HTTP front "
        "end in this one, over ZeroMQ; a dead engine process is restarted. off: a thread of "
        "this process (the default: see docs/operator/engine-process.md). "
        "Default from $KVGATE_ENGINE_PROCESS",
    )
    c.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a stopping server (SIGTERM) or replica gives its requests in flight",
    )
    lim = p.add_argument_group("limits (refused before any work is done on the request)")
    d = RequestLimits()
    lim.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body (413 above it)",
    )
    lim.add_argument(
        "--max-upload-bytes",
        type=int,
        default=d.max_upload_bytes,
        help="largest file upload, POST /v1/files (413 above it)",
    )
    lim.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt in characters, before tokenizing (default: the "
        "context times the longest token's characters)",
    )
    lim.add_argument(
        "--max-messages", type=int, default=d.max_messages, help="most messages in a chat request"
    )
    lim.add_argument("--max-stop", type=int, default=d.max_stop, help="most stop strings")
    lim.add_argument(
        "--max-stop-chars", type=int, default=d.max_stop_chars, help="longest stop string"
    )
    lim.add_argument(
        "--max-stop-token-ids", type=int, default=d.max_stop_token_ids, help="most stop_token_ids"
    )
    lim.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="seconds to send a request's headers before the connection closes",
    )
    lim.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        help="seconds without body bytes before the request gets 408",
    )
    lim.add_argument(
        "--body-deadline",
        type=float,
        default=d.body_deadline,
        help="seconds a whole request body may take before the request gets 408",
    )
    lim.add_argument(
        "--min-body-rate",
        type=int,
        default=d.min_body_rate,
        help="slowest average body rate in bytes/s, after --body-rate-grace (408 below; 0: off)",
    )
    lim.add_argument(
        "--body-rate-grace",
        type=float,
        default=d.body_rate_grace,
        help="seconds of a body before --min-body-rate applies",
    )
    lim.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections past which requests get 503",
    )
    lim.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open connections from one address past which one is refused with 503 "
        "(default: a quarter of --max-connections)",
    )
    lim.add_argument(
        "--stalled-client-timeout",
        type=float,
        default=d.stalled_client_timeout,
        help="seconds a stream may wait for its client to read before it is aborted",
    )


@dataclass(frozen=True)
class ModelToServe:
    """One model of ``kvgate serve``: the name clients send, its engine's configuration,
    and its weight in the split of the KV memory budget."""

    name: str
    engine: EngineConfig
    kv_weight: float = 1.0


#: Engine settings a ``models`` entry of the config file may set for its model alone.
_PER_MODEL = frozenset({
    "dtype", "quantization", "gguf_blocks", "kv_cache_dtype", "kv_tier", "kv_tier_size",
    "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "num_spare_seqs", "block_size", "enable_prefix_caching",
    "native_kernels", "speculative", "num_speculative_tokens", "speculative_ngram_min",
    "speculative_ngram_max",
})  # fmt: skip


def default_name(model: str) -> str:
    """The served name of ``--model``: a shipped alias as is, a path's last part."""
    return model if model == DEFAULT_MODEL else os.path.basename(model.rstrip("/"))


def models_to_serve(
    a: argparse.Namespace, base: EngineConfig, file_models: Sequence[Mapping[str, Any]] = ()
) -> list[ModelToServe]:
    """The models to serve: ``--model`` (repeatable) with ``--served-model-name`` and
    ``--kv-weight`` by position, else the config file's ``models`` list, else the default
    model; ``base`` holds the engine settings they share. The KV budget (``base``'s
    ``kv_cache_memory``, a fraction resolved once, now) is split by weight."""
    names = list(a.served_model_name or ())
    weights = list(a.kv_weight or ())
    entries: list[dict[str, Any]]
    if a.model:
        entries = [{"model": m} for m in a.model]
        if len(names) > len(entries) or len(weights) > len(entries):
            raise InvalidConfig(
                f"{len(entries)} --model but {len(names)} --served-model-name and "
                f"{len(weights)} --kv-weight: give at most one of each per --model",
                param="served_model_name",
            )
        for entry, name in zip(entries, names, strict=False):
            entry["name"] = name
        for entry, weight in zip(entries, weights, strict=False):
            entry["kv_weight"] = weight
    elif file_models:
        entries = [dict(m) for m in file_models]
        if len(entries) == 1 and names:
            entries[0].setdefault("name", names[0])
    else:
        entries = [{"model": DEFAULT_MODEL, **({"name": names[0]} if names else {})}]
    models = [_model_entry(e, base, i) for i, e in enumerate(entries)]
    seen: set[str] = set()
    for m in models:
        if m.name in seen:
            raise InvalidConfig(
                f"two models are served as {m.name!r}; give each its own --served-model-name",
                param="served_model_name",
            )
        seen.add(m.name)
    if len(models) == 1:
        return models
    total = parse_memory(base.kv_cache_memory, available_memory_bytes())
    weight = sum(m.kv_weight for m in models)
    return [
        dataclasses.replace(
            m,
            engine=dataclasses.replace(
                m.engine, kv_cache_memory=max(1, int(total * m.kv_weight / weight))
            ),
        )
        for m in models
    ]


def _model_entry(entry: Mapping[str, Any], base: EngineConfig, i: int) -> ModelToServe:
    where = f"models[{i}]"
    model = entry.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidConfig(f"{where}: needs 'model', a name or a path", param="models")
    name = entry.get("name", default_name(model))
    if not isinstance(name, str) or not name:
        raise InvalidConfig(f"{where}.name must be a non-empty string", param="models")
    weight = entry.get("kv_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise InvalidConfig(
            f"{where}.kv_weight must be a positive number, got {weight!r}", param="kv_weight"
        )
    settings = {k.replace("-", "_"): v for k, v in entry.items()}
    unknown = set(settings) - _PER_MODEL - {"model", "name", "kv_weight"}
    if unknown:
        known = ", ".join(sorted(_PER_MODEL | {"model", "name", "kv_weight"}))
        raise InvalidConfig(
            f"{where}: unknown setting(s) {sorted(unknown)}; known: {known}", param="models"
        )
    overrides = {k: v for k, v in settings.items() if k in _PER_MODEL}
    if i:  # --lora-modules are the first model's adapters
        overrides["lora_modules"] = ()
    return ModelToServe(
        name, dataclasses.replace(base, model=model, **overrides), kv_weight=float(weight)
    )


def add_ingest_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ingestion limits (per file; past one, the file fails alone)")
    d = IngestLimits()
    g.add_argument("--ingest-job-timeout", type=float, default=d.job_seconds,
                   help="seconds one file's ingestion may run before it is stopped")  # fmt: skip
    g.add_argument("--ingest-memory-mib", type=int, default=d.memory_bytes // MiB,
                   help="MiB of memory the ingestion process may hold")  # fmt: skip
    g.add_argument("--ingest-max-chars", type=int, default=d.max_text_chars,
                   help="characters of text one file may have")  # fmt: skip
    g.add_argument("--ingest-max-pages", type=int, default=d.max_pdf_pages,
                   help="pages one PDF may have")  # fmt: skip
    g.add_argument("--ingest-max-unzipped-mib", type=int, default=d.max_unzipped_bytes // MiB,
                   help="MiB a .docx may inflate to (its parts, as declared)")  # fmt: skip


def ingest_limits(a: argparse.Namespace) -> IngestLimits:
    return IngestLimits(
        max_unzipped_bytes=a.ingest_max_unzipped_mib * MiB,
        max_pdf_pages=a.ingest_max_pages,
        max_text_chars=a.ingest_max_chars,
        job_seconds=a.ingest_job_timeout,
        memory_bytes=a.ingest_memory_mib * MiB,
    )


def server_config(a: argparse.Namespace, models: Sequence[ModelToServe] = ()) -> ServerConfig:
    """``models``: what ``models_to_serve`` gave (the first names the default model)."""
    if models:
        name = models[0].name
    elif a.served_model_name:
        name = a.served_model_name[0]
    else:
        name = default_name(a.model[0] if a.model else DEFAULT_MODEL)
    return ServerConfig(
        host=a.host,
        port=a.port,
        served_model_name=name,
        api_keys_file=a.api_keys_file,
        tenants_file=a.tenants,
        metrics_keys=tuple(a.metrics_key),
        scheduling=a.scheduling,
        max_queue_len=a.max_queue_len,
        access_log=a.access_log,
        usage_db=a.usage_db,
        data_dir=a.data_dir,
        strict_data_dir=a.strict_data_dir,
        docs_url=a.docs_url,
        responses_retention=a.responses_retention,
        ingest_priority=a.ingest_priority,
        ingest_limits=ingest_limits(a),
        embed_precision=a.embed_precision,
        log_level=a.log_level,
        shutdown_timeout=a.shutdown_timeout,
        engine_process=a.engine_process == "on",
        rates_unreachable=a.rates_unreachable,
        limits=RequestLimits(
            max_body_bytes=a.max_body_bytes,
            max_upload_bytes=a.max_upload_bytes,
            max_prompt_chars=a.max_prompt_chars,
            max_messages=a.max_messages,
            max_stop=a.max_stop,
            max_stop_chars=a.max_stop_chars,
            max_stop_token_ids=a.max_stop_token_ids,
            header_timeout=a.header_timeout,
            body_timeout=a.body_timeout,
            body_deadline=a.body_deadline,
            min_body_rate=a.min_body_rate,
            body_rate_grace=a.body_rate_grace,
            max_connections=a.max_connections,
            max_connections_per_client=a.max_connections_per_client,
            stalled_client_timeout=a.stalled_client_timeout,
        ),
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``kvgate serve``: the server's, then the engine's."""
    add_server_args(p)
    add_engine_args(p, several_models=True)


def serve_parser() -> argparse.ArgumentParser:
    """``kvgate serve``'s own parser (the CLI's subparser has the same flags)."""
    p = argparse.ArgumentParser(prog="kvgate serve")
    add_serve_args(p)
    return p


def parse_serve(argv: Sequence[str]) -> argparse.Namespace:
    """``kvgate serve ARGV`` parsed; with ``--config FILE`` the file's settings come first,
    so flags win. ``argv`` and ``file_models`` (the file's ``models`` list) are kept on it."""
    parser = serve_parser()
    given = list(argv)
    args = parser.parse_args(given)
    file_models: list[dict[str, Any]] = []
    if args.config:
        flags = args
        args = parser.parse_args([*config_file_argv(args.config, parser), *given])
        # Repeatable flags on the command line replace the file's, as single ones do.
        for name in ("model", "served_model_name", "kv_weight"):
            if getattr(flags, name) is not None:
                setattr(args, name, getattr(flags, name))
        file_models = config_file_models(args.config)
    args.argv = given  # for the replicas of ``--replicas``
    args.file_models = file_models
    return args


@dataclass(frozen=True)
class Launch:
    """A server to start: its models (the first is the default), its settings, and the
    arguments it came from (the replicas of ``--replicas`` are started with the same)."""

    models: tuple[ModelToServe, ...]
    config: ServerConfig
    argv: tuple[str, ...] = field(default=())


def launch_of(a: argparse.Namespace) -> Launch:
    """The :class:`Launch` of parsed ``kvgate serve`` arguments (see :func:`parse_serve`)."""
    models = models_to_serve(a, engine_config(a), getattr(a, "file_models", ()))
    return Launch(tuple(models), server_config(a, models), tuple(getattr(a, "argv", ())))


def serve_settings(argv: Sequence[str]) -> Launch:
    """What ``kvgate serve ARGV`` would serve; raises ``InvalidConfig`` (or exits, as
    argparse does, for an unknown flag) before anything starts."""
    return launch_of(parse_serve(argv))
