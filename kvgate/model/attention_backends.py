"""The attention backends kvgate has, and how the engine gets one: it asks for a backend
that supports the model's KV spec (``kv_spec.py``) on its device, never builds one itself.

Each backend owns its cache tensors' shape and dtype (``AttentionBackend.kv_cache_shape``),
the reading and writing of them, and says why it cannot serve a spec (``supports``). A new
KV format or device is one backend module and one ``register`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvgate.errors import UnsupportedModel
from kvgate.model.attention import AttentionBackend, TorchAttention
from kvgate.model.compressed_kv import CompressedKV
from kvgate.model.kv_codec import STORAGE, KVCodec, codec_for
from kvgate.model.kv_layout import KVLayout
from kvgate.model.kv_spec import KVSpec

if TYPE_CHECKING:
    from kvgate.model.cpu_kernels import PagedDecodeKernel


@dataclass(frozen=True)
class BackendOptions:
    """What a backend needs beyond the spec: the model's query heads and score scale (None:
    ``k_dim ** -0.5``), the device, and the CPU's native attention kernels (None: none)."""

    num_heads: int
    device: torch.device
    scale: float | None = None
    decode_kernel: PagedDecodeKernel | None = None
    #: bf16 attention matmuls in float32 (``precision.upcast_attention``).
    upcast: bool = False
    #: The pool's layout (the compressed backend addresses its groups' blocks).
    layout: KVLayout | None = None
    #: The dtype attention computes in (the model's); K/V stored otherwise (the spec's
    #: dtype) go through a ``kv_codec.KVCodec``. None: the spec's dtype.
    compute_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class BackendEntry:
    name: str
    #: None where the backend serves the spec with these options; else why not.
    supports: Callable[[KVSpec, BackendOptions], str | None]
    build: Callable[[KVSpec, BackendOptions], AttentionBackend]


_BACKENDS: dict[str, BackendEntry] = {}


def register(entry: BackendEntry) -> None:
    """Add a backend; the first registered that supports a spec is chosen."""
    _BACKENDS[entry.name] = entry


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def select_backend(
    spec: KVSpec, options: BackendOptions, name: str | None = None
) -> tuple[str, AttentionBackend]:
    """The first registered backend (or the one named) that supports ``spec``, built, with
    its name. Raises UnsupportedModel naming every backend's reason when none does."""
    if name is not None and name not in _BACKENDS:
        raise UnsupportedModel(
            f"no attention backend {name!r} (there are: {', '.join(_BACKENDS)})",
            path="<config>",
        )
    reasons = []
    for entry in _BACKENDS.values():
        if name is not None and entry.name != name:
            continue
        why = entry.supports(spec, options)
        if why is None:
            return entry.name, entry.build(spec, options)
        reasons.append(f"{entry.name}: {why}")
    raise UnsupportedModel(
        f"no attention backend serves KV pages {spec} on {options.device}: " + "; ".join(reasons),
        path="<config>",
    )


def _torch_supports(spec: KVSpec, options: BackendOptions) -> str | None:
    if spec.kind not in ("full", "sliding"):
        return f"it reads full and sliding-window K/V, not {spec.kind!r}"
    if spec.k_dim != spec.v_dim:
        return f"its K and V have one head size (here {spec.k_dim} and {spec.v_dim})"
    if options.num_heads % spec.num_kv_heads:
        return f"{options.num_heads} query heads do not share {spec.num_kv_heads} KV heads"
    return None


def _codec(spec: KVSpec, options: BackendOptions) -> KVCodec | None:
    if options.compute_dtype is None:
        return None
    return codec_for(spec.dtype, options.compute_dtype)


def _storage(spec: KVSpec) -> torch.dtype:
    return STORAGE[spec.dtype]


def _torch_build(spec: KVSpec, options: BackendOptions) -> AttentionBackend:
    return TorchAttention(
        options.num_heads,
        spec.num_kv_heads,
        spec.k_dim,
        decode_kernel=options.decode_kernel,
        upcast=options.upcast,
        scale=options.scale,
        kv_dtype=_storage(spec),
        codec=_codec(spec, options),
    )


register(BackendEntry("torch-paged", _torch_supports, _torch_build))


def _latent_supports(spec: KVSpec, options: BackendOptions) -> str | None:
    if spec.kind != "latent":
        return f"it reads latent vectors, not {spec.kind!r} K/V"
    return None


def _latent_build(spec: KVSpec, options: BackendOptions) -> AttentionBackend:
    """Multi-head latent attention, absorbed: every query head (its no-position part already
    multiplied into the latent space) attends over the one latent vector a token, and the
    output is in the latent space too (the model projects it to each head's value)."""
    return TorchAttention(
        options.num_heads,
        1,
        spec.k_dim,
        upcast=options.upcast,
        scale=options.scale,
        kv_dtype=_storage(spec),
        v_dim=spec.v_dim,
        v_in_k=True,
        codec=_codec(spec, options),
    )


register(BackendEntry("torch-latent", _latent_supports, _latent_build))


def _compressed_supports(spec: KVSpec, options: BackendOptions) -> str | None:
    if spec.kind != "compressed":
        return f"it reads a window and compressed entries, not {spec.kind!r} K/V"
    if options.layout is None or not options.layout.specs:
        return "it needs the pool's layout of compressed layers"
    if options.compute_dtype is not None and _codec(spec, options) is not None:
        return f"it stores pages as the model computes them, not as {spec.dtype}"
    return None


def _compressed_build(spec: KVSpec, options: BackendOptions) -> AttentionBackend:
    """The window and entry streams of compressed layers (DeepSeek-V4), in PyTorch: the
    model attends over what it reads of them (``compressed_kv.py``)."""
    return CompressedKV(options.layout, _storage(spec))  # type: ignore[return-value]


register(BackendEntry("torch-compressed", _compressed_supports, _compressed_build))
