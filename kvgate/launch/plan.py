"""``kvgate plan``: the memory a model takes and how many sequences of a length fit beside it,
predicted from the checkpoint's headers and the engine's own rules, without building the
model or allocating the KV pool. ``kvgate serve`` logs the same plan for each model it
starts (``log_plan``); ``allocation`` reads the same figures off a built engine, which the
tests (``tests/launch/test_plan.py``) and ``bench/plan_check.py`` hold the plan to.

What is counted, in bytes:

- **weights**: what the built model holds on this machine (``model/weight_bytes.py``, from
  the checkpoint's headers alone): in the compute dtype ``--dtype`` resolves to here, a
  GGUF's block matrices kept or dequantized as the engine decides, ``--quantization`` int8,
  the layers' packed copies, a tied LM head's own copy where it has one, the norms and the
  RoPE tables.
- **KV**: from the ``KVLayout`` the engine builds (the model class's ``kv_specs`` in the KV
  dtype), so exact: K and V of a token in every layer (int8/fp8 rows with their float32
  scales), a pool block, and the blocks one sequence of ``max_model_len`` holds at most
  (``KVLayout.max_blocks``: a sliding group's window caps them).
- **runtime** (an estimate): the process itself (its resident set when the plan is made:
  the interpreter, torch, the kernels; the server's web stack adds tens of MiB), one step's
  activations for ``max_num_batched_tokens`` rows (the residual and normed hidden states,
  the fused q/k/v, the attention output, the MLP's gate and up and their product, in the
  compute dtype), attention's working set (a prefill's context K and V gathered at
  ``max_model_len`` and decoded to float32, the float32 scores of a short prompt), and the
  logits of a step's sampled rows in float32 with the sampler's working copy beside them.
  Not counted: the tokenizer, compiled grammars, the prefix cache's bookkeeping, a
  ``--kv-tier`` (on disk).
- **margin**: ``--margin`` of the total (10%).

With ``--memory`` (the server's whole budget) the KV pool gets what is left, memory -
weights - runtime - margin, in whole MiB: the ``--kv-cache-memory`` to pass. Without it,
``--kv-cache-memory`` is the pool and the plan says the memory it needs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvgate.config import KV_CACHE_DTYPES, EngineConfig, available_memory_bytes, parse_memory
from kvgate.errors import InvalidConfig, KVGateError
from kvgate.model.config import ModelConfig
from kvgate.model.kv_layout import KVLayout
from kvgate.model.kv_spec import KVSpec
from kvgate.model.models import model_class
from kvgate.model.stored_weights import StoredModel, read_stored_model
from kvgate.model.weight_bytes import Host, WeightPlan, predict_weights

if TYPE_CHECKING:
    from kvgate.engine.llm_engine import LLMEngine

__all__ = [
    "DEFAULT_MARGIN",
    "Allocation",
    "Host",
    "KVPlan",
    "Plan",
    "Runtime",
    "WeightPlan",
    "allocation",
    "log_plan",
    "plan",
    "plan_for",
    "render",
    "resident_bytes",
]

log = logging.getLogger("kvgate.plan")

MiB = 1 << 20
#: The share of the total memory kept free (``--margin``).
DEFAULT_MARGIN = 0.10
#: Rows of a short fresh prompt whose causal scores are materialized (``attention.py``).
_SHORT_PREFILL = 256


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Runtime:
    """What the server holds beside its weights and KV pool (bytes; an estimate)."""

    process: int  # the interpreter and its libraries (resident when planned)
    activations: int  # one step's, for ``max_num_batched_tokens`` rows
    attention: int  # a prefill's context gathered, a short prompt's scores
    logits: int  # the sampled rows' float32 logits and the sampler's copy

    @property
    def total(self) -> int:
        return self.process + self.activations + self.attention + self.logits


@dataclass(frozen=True)
class KVPlan:
    """The pool for one KV dtype (bytes; blocks of ``block_size`` tokens)."""

    asked: str  # ``--kv-cache-dtype`` as given (``auto`` included)
    kv_dtype: str  # as stored
    bytes_per_token: int  # K and V of one token in every layer
    block_bytes: int  # one block of the pool (``KVLayout.block_bytes``)
    block_size: int
    seq_blocks: int  # blocks one sequence of ``max_model_len`` holds at most
    num_blocks: int  # the pool's
    #: With ``concurrency``: the total memory and the ``--kv-cache-memory`` N sequences of
    #: ``max_model_len`` need (None: no concurrency asked).
    memory_for_concurrency: int | None = None
    kv_cache_memory_for_concurrency: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def sequences(self) -> int:
        """Sequences of ``max_model_len`` the pool holds at once."""
        return self.num_blocks // self.seq_blocks


@dataclass(frozen=True)
class Plan:
    model: str  # as named
    path: str  # the file or directory read
    architecture: str
    num_layers: int
    dtype: str  # the compute dtype
    dtype_why: str
    weights: WeightPlan
    runtime: Runtime
    margin: float  # of ``memory``
    memory: int  # total bytes: as given (``memory_given``), or what the pool needs
    memory_given: bool
    #: Bytes for the KV pool: memory - weights - runtime - margin (at least 0) with
    #: ``memory_given``, else ``--kv-cache-memory``'s.
    kv_budget: int
    kv_cache_memory: str  # the ``--kv-cache-memory`` that gives each pool below
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    concurrency: int | None
    kv: tuple[KVPlan, ...]

    @property
    def margin_bytes(self) -> int:
        return int(self.memory * self.margin)

    @property
    def fits(self) -> bool:
        """Whether every KV dtype's pool holds ``concurrency`` sequences (one, without)."""
        return all(kv.sequences >= (self.concurrency or 1) for kv in self.kv)


def plan(
    stored: StoredModel,
    config: EngineConfig,
    host: Host,
    *,
    memory: str | None = None,
    margin: float = DEFAULT_MARGIN,
    concurrency: int | None = None,
    kv_dtypes: Sequence[str] | None = None,
    process_bytes: int = 0,
    available_bytes: int | None = None,
) -> Plan:
    """The plan of ``config``'s model (read as ``stored``) on ``host``: no file is read and
    nothing allocated. ``memory``: the server's whole budget (as ``--kv-cache-memory``
    reads sizes: ``8GiB``, or a fraction of ``available_bytes``); None: the pool is
    ``config.kv_cache_memory`` and the plan says what it needs. ``kv_dtypes``: the KV dtypes
    to plan (None: ``config.kv_cache_dtype``). ``process_bytes``: the process's own.

    Raises:
        InvalidConfig: a setting out of range (naming it), or ``max_model_len`` above the
            model's context.
    """
    if not 0.0 <= margin < 1.0:
        raise InvalidConfig(f"margin must be in [0, 1), got {margin}", param="margin")
    if concurrency is not None and concurrency <= 0:
        raise InvalidConfig(
            f"concurrency must be a positive integer, got {concurrency}", param="concurrency"
        )
    for asked in kv_dtypes or ():
        if asked not in KV_CACHE_DTYPES:
            raise InvalidConfig(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {asked!r}",
                param="kv_cache_dtype",
            )
    c = stored.config
    max_len = _max_model_len(config, c)
    weights = predict_weights(stored, config, host)
    runtime = _runtime(c, config, host, max_len, process_bytes)
    fixed = weights.total + runtime.total
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if memory is not None:
        total = _parse_size(memory, available, "memory")
        budget = max(total - fixed - int(total * margin), 0)
        pool, flag = budget // MiB * MiB, f"{budget // MiB}MiB"
    else:
        pool = budget = parse_memory(config.kv_cache_memory, available)
        total, flag = _needed(fixed + pool, margin), str(config.kv_cache_memory)
    kv: list[KVPlan] = []
    for asked in kv_dtypes or (config.kv_cache_dtype,):
        one = _kv_plan(c, config, host, asked, pool, max_len, fixed, margin, concurrency)
        if all(one.kv_dtype != other.kv_dtype for other in kv):  # ``auto``'s dtype once
            kv.append(one)
    return Plan(
        model=config.model,
        path=stored.path,
        architecture=c.architecture,
        num_layers=c.num_layers,
        dtype=_name(host.dtype),
        dtype_why=host.dtype_why,
        weights=weights,
        runtime=runtime,
        margin=margin,
        memory=total,
        memory_given=memory is not None,
        kv_budget=budget,
        kv_cache_memory=flag,
        max_model_len=max_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        concurrency=concurrency,
        kv=tuple(kv),
    )


def plan_for(
    config: EngineConfig,
    *,
    memory: str | None = None,
    margin: float = DEFAULT_MARGIN,
    concurrency: int | None = None,
    kv_dtypes: Sequence[str] | None = None,
    process_bytes: int | None = None,
) -> Plan:
    """``plan`` of ``config`` on this machine: reads the checkpoint's headers, probes the
    kernels; ``process_bytes`` None: this process's resident set now."""
    host = Host.probe(config)
    stored = read_stored_model(config.model)
    return plan(
        stored,
        config,
        host,
        memory=memory,
        margin=margin,
        concurrency=concurrency,
        kv_dtypes=kv_dtypes,
        process_bytes=resident_bytes() if process_bytes is None else process_bytes,
        available_bytes=_device_memory(host.device),
    )


def _max_model_len(config: EngineConfig, c: ModelConfig) -> int:
    """``LLMEngine._resolve_max_model_len``."""
    asked = config.max_model_len
    if asked is None:
        return c.max_position_embeddings
    if asked > c.max_position_embeddings:
        raise InvalidConfig(
            f"max_model_len {asked} exceeds the model's context of "
            f"{c.max_position_embeddings} tokens",
            param="max_model_len",
        )
    return asked


def _parse_size(value: str, available: int, param: str) -> int:
    try:
        size = parse_memory(value, available)
    except InvalidConfig as exc:  # it names kv_cache_memory
        raise InvalidConfig(
            f"{param} must look like '8GiB', '512MiB' or a fraction like 0.8, got {value!r}",
            param=param,
        ) from exc
    if size <= 0:
        raise InvalidConfig(f"{param} must be positive, got {value!r}", param=param)
    return size


def _needed(held: int, margin: float) -> int:
    """The total memory, in whole MiB, of which ``held`` bytes leave ``margin`` free."""
    return math.ceil(held / (1.0 - margin) / MiB) * MiB


def _kv_plan(
    c: ModelConfig,
    config: EngineConfig,
    host: Host,
    asked: str,
    pool: int,
    max_len: int,
    fixed: int,
    margin: float,
    concurrency: int | None,
) -> KVPlan:
    """One KV dtype's layout, as ``LLMEngine.__init__`` builds it, and its pool."""
    kv_dtype = _name(host.dtype) if asked == "auto" else asked
    specs: list[KVSpec] = [s.with_dtype(kv_dtype) for s in model_class(c).kv_specs(c)]
    bs = config.block_size
    layout = KVLayout.for_specs(specs, bs)
    block = layout.block_bytes(bs)
    seq_blocks = layout.max_blocks(max_len, bs, config.max_num_batched_tokens)
    out = KVPlan(
        asked=asked,
        kv_dtype=kv_dtype,
        bytes_per_token=sum(s.bytes_per_token() for s in specs),
        block_bytes=block,
        block_size=bs,
        seq_blocks=seq_blocks,
        num_blocks=pool // block,
    )
    if concurrency is None:
        return out
    need = math.ceil(concurrency * seq_blocks * block / MiB) * MiB
    return replace(
        out,
        memory_for_concurrency=_needed(fixed + need, margin),
        kv_cache_memory_for_concurrency=f"{need // MiB}MiB",
    )


def _runtime(
    c: ModelConfig, config: EngineConfig, host: Host, max_len: int, process: int
) -> Runtime:
    """The module docstring's runtime, in bytes."""
    s, t = host.dtype.itemsize, config.max_num_batched_tokens  # bytes a value; rows a step
    hq, hkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim  # values a token
    # residual and normed h (2 H), fused q/k/v (Hq + 2 Hkv), attention out (Hq), gate and
    # up (2 I) and their product (I)
    activations = t * (2 * c.hidden_size + hq + 2 * hkv + hq + 3 * c.intermediate_size) * s
    # K and V of max_len tokens gathered and decoded (float32: 4 B), a short prompt's
    # float32 scores [heads, rows, rows]
    short = min(t, _SHORT_PREFILL)
    attention = 2 * hkv * max_len * 4 + c.num_heads * short * short * 4
    # sampled rows: one a sequence (1 + k with speculative drafts), at most a step's tokens;
    # float32 logits and the sampler's working copy
    spec = config.speculative_config()
    rows = min(config.max_num_seqs * (1 + (spec.num_tokens if spec else 0)), t)
    logits = 2 * rows * c.vocab_size * 4
    return Runtime(process, activations, attention, logits)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resident_bytes() -> int:
    """This process's resident set (Linux), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _device_memory(device: torch.device) -> int:
    """What a fraction of ``--kv-cache-memory`` is of (``LLMEngine._size_kv_pool``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory_bytes()


# ----------------------------------------------------------------------------- rendering
def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def render(p: Plan) -> str:
    """The plan as a table: the fixed costs, then one row per KV dtype."""
    w, r = p.weights, p.runtime
    memory = "given" if p.memory_given else f"needed for --kv-cache-memory {p.kv_cache_memory}"
    lines = [
        f"model       {p.model} ({p.path})",
        f"            {p.architecture}, {p.num_layers} layers, "
        f"{w.parameters / 1e6:.1f}M parameters; compute {p.dtype} ({p.dtype_why})",
        f"memory      {_size(p.memory):>11}  {memory}",
        f"weights     {_size(w.total):>11}  {w.why}: layers {_size(w.linears)}, embedding "
        f"{_size(w.embedding)}, LM head {_size(w.head) if w.head else 'shared'}, norms "
        f"{_size(w.vectors)}, RoPE tables {_size(w.rope)}",
        f"runtime     {_size(r.total):>11}  process {_size(r.process)}, activations "
        f"{_size(r.activations)} ({p.max_num_batched_tokens} tokens), attention "
        f"{_size(r.attention)}, logits {_size(r.logits)} (estimates)",
        f"margin      {_size(p.margin_bytes):>11}  {p.margin:.0%} of memory",
        f"KV budget   {_size(p.kv_budget):>11}  "
        + ("memory - weights - runtime - margin" if p.memory_given else "--kv-cache-memory"),
        f"sequences of {p.max_model_len} tokens (--max-model-len), blocks of "
        f"{p.kv[0].block_size} tokens, --kv-cache-memory {p.kv_cache_memory}:",
        "",
    ]
    head = ["kv dtype", "KV B/token", "block B", "blocks/seq", "pool blocks", "pool tokens",
            "seqs"]  # fmt: skip
    if p.concurrency is not None:
        head += [f"{p.concurrency} fit", "memory needed", "--kv-cache-memory"]
    rows = [head]
    for kv in p.kv:
        name = kv.kv_dtype + (" (auto)" if kv.asked == "auto" else "")
        row = [name, f"{kv.bytes_per_token:,}", f"{kv.block_bytes:,}", f"{kv.seq_blocks:,}",
               f"{kv.num_blocks:,}", f"{kv.num_tokens:,}", f"{kv.sequences:,}"]  # fmt: skip
        if p.concurrency is not None:
            assert kv.memory_for_concurrency is not None
            row += [
                "yes" if kv.sequences >= p.concurrency else "no",
                _size(kv.memory_for_concurrency),
                str(kv.kv_cache_memory_for_concurrency),
            ]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            v.rjust(n) for v, n in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    if any(kv.sequences > p.max_num_seqs for kv in p.kv):
        lines.append(f"(at most --max-num-seqs {p.max_num_seqs} of them run in one step)")
    return "\n".join(lines)


def log_plan(config: EngineConfig, name: str | None = None) -> Plan | None:
    """Log the plan of ``config`` at start (``kvgate serve``); a plan that cannot be made is
    a warning, never a failed start (the engine's own load reports the cause)."""
    try:
        p = plan_for(config)
    except Exception as exc:  # a plan never stops a start
        why = exc.message if isinstance(exc, KVGateError) else f"{type(exc).__name__}: {exc}"
        log.warning("model %r: no memory plan: %s", name or config.model, why)
        return None
    for line in render(p).splitlines():
        if line:
            log.info("plan %s: %s", name or config.model, line)
    return p


# ----------------------------------------------------------------------------- the check
@dataclass(frozen=True)
class Allocation:
    """What a built engine holds, read off its tensors, in the plan's terms (bytes)."""

    weight_bytes: int  # every tensor the model reaches, each storage once (no KV caches)
    #: The attention backend's cache of a token in every layer (``kv_block_bytes``; not
    #: comparable for compressed layers, whose backend counts a block otherwise).
    bytes_per_token: int
    block_bytes: int  # the KV tensors allocated, per block of the pool
    num_blocks: int
    seq_blocks: int  # ``blocks_for(max_model_len)``


def allocation(engine: LLMEngine) -> Allocation:
    """The figures of ``engine`` a ``Plan`` predicts, measured: its model's tensors walked
    (parameters, packed copies, block views, tables), its KV tensors summed."""
    caches = {_storage(t) for pair in engine.runner.kv_caches for t in pair}
    weights = {key for key in map(_storage, _tensors(engine.model)) if key not in caches}
    pool = engine.kv_pool
    layers, bs = engine.model_config.num_layers, pool.block_size
    return Allocation(
        weight_bytes=sum(n for _, n in weights),
        bytes_per_token=layers * engine.model.attention.kv_block_bytes(bs) // bs,
        block_bytes=sum(n for _, n in caches) // pool.num_blocks,
        num_blocks=pool.num_blocks,
        seq_blocks=engine.blocks_for(engine.max_model_len),
    )


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(where, bytes) of the memory a tensor lives in: views of one storage count once."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's packed weights)
        return id(t), t.numel() * t.element_size()


_LEAVES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, type)
_CODE = types.ModuleType | types.FunctionType | types.BuiltinFunctionType | types.MethodType


def _tensors(root: object) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, containers and partials."""
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, functools.partial):
            stack.extend((*obj.args, *obj.keywords.values()))
        elif isinstance(obj, _CODE | ctypes.CDLL) or type(obj).__module__ == "ctypes":
            continue  # code and C libraries: no tensors
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, slot, None))
