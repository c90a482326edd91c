"""Whole decoder layers of a pure decode step in one native call (``csrc/decode_layers.c``).

The per-op path calls 9 kernels a layer through ctypes, each after allocating its output and
converting its arguments (~16 us on a 2.0 GHz AMD EPYC core): at batch 1 that is 4-7 ms of
a ~20 ms token. ``NativeDecode`` describes the model's layers to C once (weights, norms,
caches) and then runs layers with one call, on the same kernels in the same order: its
results are bit-identical to the per-op path (tested), only the calls' cost goes.

It applies to bf16 models whose every linear, attention and element-wise op has a native
kernel (``NativeDecode.build`` returns None otherwise: the one fallback rule again), with
K/V stored as bf16 or as int8/fp8 rows (``kv_codec``: written by the fused RoPE + KV write's
encoder, read in place by the quantized paged decode), and to steps with no prefill in them;
anything else takes the per-op path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgate.model.attention import AttentionMetadata, TorchAttention
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import KernelCall, KernelLibrary, PagedDecodeKernel, load_library
from kvgate.model.linear import Bf16DotLinear, Linear, WidenLinear
from kvgate.model.ops import FusedCpuLayerOps
from kvgate.model.quant_linear import QuantLinear

_P = ctypes.c_void_p
_I = ctypes.c_int32

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
#: A layer as the model gives it: (qkv, o, gate_up, down), post-attention norm, next norm,
#: key offset (or None); and as described to C, its linears as kernel calls.
Layer = tuple[Sequence[Linear], torch.Tensor, torch.Tensor, torch.Tensor | None]
Described = tuple[Sequence[KernelCall], torch.Tensor, torch.Tensor, torch.Tensor | None]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("fn", _P), ("weight", _P), ("scale", _P), ("bias", _P),
        ("kind", _I), ("n", _I), ("k", _I), ("wtype", _I),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("post_norm", _P), ("next_norm", _P), ("k_cache", _P), ("v_cache", _P),
        ("k_offset", _P),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("rope", _P), ("attend", _P), ("add_norm", _P), ("silu_mul", _P),
        ("cos", _P), ("sin_signed", _P),
        ("hq", _I), ("hkv", _I), ("d", _I), ("hidden", _I), ("inter", _I),
        ("num_blocks", _I), ("block_size", _I),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("kv_groups", _I), ("fp8", _P), ("rope_q8", _P), ("attend_q8", _P),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("positions", _P), ("slots", _P), ("tables", _P), ("lens", _P),
        ("residual", _P), ("h", _P), ("scratch", _P),
        ("t", _I), ("max_blocks", _I),
    ]  # fmt: skip


@dataclass(frozen=True)
class DecodeStep:
    """One step's arguments, and the tensors they point into (kept alive with them)."""

    args: _Step
    owners: tuple[object, ...]


def _kernel_call(linear: Linear) -> KernelCall | None:
    if isinstance(linear, WidenLinear | Bf16DotLinear | QuantLinear):
        return linear.kernel_call()
    return None


def _as_struct(call: KernelCall) -> _Linear:
    kind = {"widen": 0, "dot": 1}[call.kind]
    return _Linear(call.fn, call.weight, call.scale, call.bias, kind, call.n, call.k, call.wtype)


class NativeDecode:
    """Runs decoder layers ``[l0, l1)`` of a decode-only step; see the module docstring.

    ``layers``: per layer its four linears (qkv, o, gate_up, down), its post-attention norm,
    the norm that follows it (the next layer's input norm, or the final norm) and what its
    quantized keys are stored less (``kv_codec.key_offset``; None: nothing).
    """

    def __init__(
        self,
        config: ModelConfig,
        library: KernelLibrary,
        attention: PagedDecodeKernel,
        ops: FusedCpuLayerOps,
        layers: Sequence[Described],
    ) -> None:
        c = config
        self.isa = library.isa
        self._attention = attention
        self._ops = ops
        self._backend = ops.attention
        ew = ops.kernel_addresses()
        self._model = _Model(
            ew["rope_write_kv"], attention.decode_address(torch.bfloat16), ew["add_norm"],
            ew["silu_mul"], ops.rope.cos.data_ptr(), ops.rope.sin_signed.data_ptr(),
            c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
            0, 0, c.rms_norm_eps, c.head_dim**-0.5,
            0, None, ew["rope_write_kv_q8"], attention.decode_q8_address(torch.bfloat16),
        )  # fmt: skip
        self._layers = (_Layer * len(layers))()
        for slot, (calls, post_norm, next_norm, key_offset) in zip(
            self._layers, layers, strict=True
        ):
            slot.qkv, slot.o, slot.gate_up, slot.down = (_as_struct(x) for x in calls)
            slot.post_norm = post_norm.data_ptr()
            slot.next_norm = next_norm.data_ptr()
            slot.k_offset = None if key_offset is None else key_offset.data_ptr()
        self._caches: KVCaches | None = None
        self._cache_ok = False
        lib = library.lib
        self._run = lib.kvg_decode_layers
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _I, _I]
        self._run.argtypes += [ctypes.POINTER(_Step)]
        self._scratch_elems = lib.kvg_scratch_elems
        self._scratch_elems.restype = ctypes.c_int64
        self._scratch_elems.argtypes = [ctypes.POINTER(_Model), _I]

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        layers: Sequence[Layer],
        ops: object,
        attention: object,
        level: str | None = None,
    ) -> NativeDecode | None:
        """None unless every op of a decode layer has a native bf16 kernel here.

        ``layers``: per layer (qkv, o, gate_up, down), post-attention norm, next norm, key
        offset. The caller (the model) keeps these alive as long as it uses what this
        returns."""
        if not isinstance(ops, FusedCpuLayerOps) or not isinstance(attention, TorchAttention):
            return None
        kernel = attention.decode_kernel
        if kernel is None or not kernel.supports(
            torch.bfloat16, attention.group, attention.head_dim, 1
        ):
            return None
        described = []
        for linears, post_norm, next_norm, key_offset in layers:
            calls = [_kernel_call(x) for x in linears]
            if any(call is None for call in calls):
                return None
            calls_ = [c for c in calls if c is not None]
            described.append((calls_, post_norm, next_norm, key_offset))
        library = load_library("decode_layers.c", level)
        if library is None:
            return None
        return cls(config, library, kernel, ops, described)

    def _bind(self, kv_caches: KVCaches) -> bool:
        """Point each layer at its caches (once per set of caches); False where the decode
        kernel cannot take them (then the per-op path runs)."""
        if kv_caches is self._caches:
            return self._cache_ok
        # The backend says how its caches lie; the C layers write and read them so only
        # where every layer's are what the fused write and the decode kernel take.
        layouts = [self._backend.native_layout(k, v) for k, v in kv_caches]
        first = layouts[0]
        m = self._model
        self._cache_ok = (
            first is not None
            and all(x == first for x in layouts)
            and self._ops.writes(first)
            and self._attention.supports(torch.bfloat16, m.hq // m.hkv, m.d, first.block_size)
        )
        if first is not None:
            m.num_blocks, m.block_size = first.num_blocks, first.block_size
            # Quantized rows: the q8 write and decode, with the fp8 value table for fp8.
            m.kv_groups = first.kv_groups if first.codec is not None else 0
            m.fp8 = self._attention.fp8_table_address() if first.codec == "fp8" else None
        for slot, (k, v) in zip(self._layers, kv_caches, strict=True):
            slot.k_cache, slot.v_cache = k.data_ptr(), v.data_ptr()
        self._caches = kv_caches
        return self._cache_ok

    def applies(self, kv_caches: KVCaches, meta: AttentionMetadata) -> bool:
        """Whether this step can run here: decodes only, caches the kernel takes."""
        return not meta.prefills and meta.num_decodes > 0 and self._bind(kv_caches)

    def start(
        self,
        positions: torch.Tensor,  # [T] int64
        residual: torch.Tensor,  # [T, H] bf16, updated in place
        h: torch.Tensor,  # [T, H] bf16: the first layer's normed input; each call's output
        meta: AttentionMetadata,
    ) -> DecodeStep:
        """The step's arguments for ``run``, made once per step (its scratch with them)."""
        t = residual.shape[0]
        scratch = torch.empty(int(self._scratch_elems(self._model, t)), dtype=torch.bfloat16)
        args = _Step(
            positions.data_ptr(), meta.slot_mapping.data_ptr(), meta.decode_blocks.data_ptr(),
            meta.decode_lens.data_ptr(), residual.data_ptr(), h.data_ptr(), scratch.data_ptr(),
            t, meta.decode_blocks.numel() // t,
        )  # fmt: skip
        return DecodeStep(args, (positions, residual, h, meta, scratch))

    def run(self, step: DecodeStep, l0: int, l1: int) -> None:
        """Layers [l0, l1) of the step ``start`` described."""
        rc = self._run(self._model, self._layers, l0, l1, step.args)
        if rc != 0:  # shapes were checked when built and bound: a bug, not bad input
            raise RuntimeError(f"native decode layers failed (op {-rc - 1})")
