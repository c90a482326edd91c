"""The bytes a model's weights take once the engine has built it, predicted from the
checkpoint's headers (``stored_weights.py``) by the rules that build it, without building
it: the engine's choices on this machine (``Host``: the compute dtype, the kernels), whether
a GGUF's block matrices stay in their blocks (``LLMEngine.__init__``,
``precision.native_blocks``), and what each layer then holds (``LinearFactory``: blocks,
Q8_0 blocks under ``--quantization``, int8 panels and their scales, packed bf16 copies,
plain tensors; ``DecoderModel``: the embedding, the LM head, the norms, the RoPE tables).

Blocks kept native are views of the file's memory map (no copy): counted, since decoding
reads every page of them. Exact for the layers ``DecoderModel`` builds from q/k/v, o,
gate/up and down projections (Llama, Qwen2/3, Gemma 3: within a few KiB on the shipped
models); other layouts (DeepSeek's experts and latent projections, V4's compressors) are
counted a tensor at a time by the same rules, an approximation. ``kvgate plan``
(``launch/plan.py``) adds the KV pool to them; ``launch.plan.allocation`` measures the same
bytes on a built model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgate.config import EngineConfig
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import CpuKernels, KernelLibrary
from kvgate.model.linear import LinearFactory
from kvgate.model.precision import native_blocks_min_bytes, resolve_dtype
from kvgate.model.quant_linear import native_qtype
from kvgate.model.quant_tensor import NATIVE_QTYPES, QuantTensor
from kvgate.model.stored_weights import INTEGER_KINDS, StoredModel, StoredWeight

__all__ = ["Host", "WeightPlan", "predict_weights"]

MiB = 1 << 20
#: The linears fused into one layer (one matmul): their parts' HF name suffix -> the layer.
_FUSED = {
    "self_attn.q_proj.weight": "qkv",
    "self_attn.k_proj.weight": "qkv",
    "self_attn.v_proj.weight": "qkv",
    "self_attn.q_proj.bias": "qkv",
    "self_attn.k_proj.bias": "qkv",
    "self_attn.v_proj.bias": "qkv",
    "mlp.gate_proj.weight": "gate_up",
    "mlp.up_proj.weight": "gate_up",
}
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
_DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: The GGML types ``load_gguf(keep_quantized=True)`` keeps in their blocks.
_NATIVE_NAMES = frozenset(t.name for t in NATIVE_QTYPES)


# ----------------------------------------------------------------------------- the host
@dataclass(frozen=True)
class Host:
    """What the engine decides from this machine before it reads a weight
    (``LLMEngine.__init__``, ``DecoderModel.__init__``)."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype
    dtype_why: str
    #: The layers' factory the model gets (it holds no weights): its kernels decide the
    #: layers' formats.
    factory: LinearFactory
    #: The block kernels are built here (``CpuKernels.quant``): a GGUF may keep its blocks.
    block_kernels: bool
    #: From how many bytes of blocks in bf16 ``--gguf-blocks auto`` keeps them native.
    native_min_bytes: int

    @staticmethod
    def probe(config: EngineConfig) -> Host:
        """This machine's, for ``config`` (builds or finds the native kernels, as the
        engine does at start)."""
        device = torch.device(config.device)
        kernels = CpuKernels.probe(enabled=config.native_kernels and device.type == "cpu")
        dtype, why = resolve_dtype(config.dtype, device, kernels)
        factory = LinearFactory.for_device(
            dtype, device, kernels.linear, config.quantization, quant=kernels.quant
        )
        return Host(
            device,
            dtype,
            why,
            factory,
            kernels.quant is not None,
            native_blocks_min_bytes(kernels.paths()),
        )


def _multiplies(library: KernelLibrary | None, kind: str) -> bool:
    """Whether the block kernels multiply weights of GGML type ``kind`` natively here."""
    if library is None or kind not in GGMLQuantizationType.__members__:
        return False
    qtype = GGMLQuantizationType[kind]
    if qtype not in NATIVE_QTYPES:
        return False
    block, size = GGML_QUANT_SIZES[qtype]
    probe = QuantTensor(qtype, (1, block), torch.zeros((1, size), dtype=torch.uint8), kind)
    return native_qtype(library, probe)


# ----------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class WeightPlan:
    """Bytes of the weights as the built model holds them."""

    linears: int  # every layer's projections (biases included)
    embedding: int
    head: int  # the LM head (0: the embedding's own blocks or tensor)
    vectors: int  # norms, lone biases, integer tables
    rope: int  # the RoPE cos/sin tables
    parameters: int  # as ``DecoderModel.num_parameters`` counts them
    why: str  # how a GGUF's blocks are held

    @property
    def total(self) -> int:
        return self.linears + self.embedding + self.head + self.vectors + self.rope


@dataclass(frozen=True)
class _Loaded:
    """A weight as ``load_checkpoint`` hands it to the model: in its blocks, or dense."""

    stored: StoredWeight
    blocks: bool  # kept in its GGML blocks (a ``QuantTensor``)
    dtype: torch.dtype | None  # dense: its dtype (None: in blocks)

    @property
    def kind(self) -> str:
        return self.stored.kind


def _as_loaded(stored: StoredModel, config: EngineConfig, host: Host) -> tuple[list[_Loaded], str]:
    """The weights as ``load_checkpoint`` gives them (``keep_quantized`` as the engine
    decides it), and after ``--gguf-blocks auto``'s choice; with that choice's reason."""
    blocks_mode = config.gguf_blocks
    keep = (
        stored.gguf
        and config.quantization is None
        and host.block_kernels
        and (blocks_mode == "native" or (blocks_mode == "auto" and config.dtype == "auto"))
    )
    out = []
    for w in stored.weights:
        kept = keep and w.kind in _NATIVE_NAMES and len(w.shape) in (2, 3)
        dense = None if kept else _DENSE.get(w.kind, torch.float32)  # dequantized: float32
        out.append(_Loaded(w, kept, dense))
    kept_ones = [x for x in out if x.blocks]
    if not stored.gguf:
        return out, "+".join(sorted({w.kind for w in stored.weights})) + " safetensors"
    if not any(w.kind not in _DENSE for w in stored.weights):
        return out, "no block-quantized matrices"
    if not keep:
        return out, f"blocks dequantized at load ({_why_not_kept(config, host)})"
    if not kept_ones:
        return out, "no block format the kernels take: dequantized at load"
    types = "+".join(sorted({x.kind for x in kept_ones}))
    bf16 = 2 * sum(x.stored.numel for x in kept_ones)
    if blocks_mode == "auto" and bf16 < host.native_min_bytes:  # ``precision.native_blocks``
        dequantized = [_Loaded(x.stored, False, torch.float32) if x.blocks else x for x in out]
        return dequantized, (
            f"{types} blocks dequantized: {bf16 / MiB:.0f} MiB in bf16 is under "
            f"{host.native_min_bytes / MiB:.0f} MiB"
        )
    return out, f"{types} blocks kept native"


def _why_not_kept(config: EngineConfig, host: Host) -> str:
    if config.quantization is not None:
        return f"--quantization {config.quantization}"
    if not host.block_kernels:
        return "no block kernels here"
    if config.gguf_blocks == "dequantize":
        return "--gguf-blocks dequantize"
    return f"--dtype {config.dtype}"


def predict_weights(stored: StoredModel, config: EngineConfig, host: Host) -> WeightPlan:
    """The bytes the model built from ``stored`` holds (see the module docstring), by the
    rules of ``LinearFactory`` and ``DecoderModel``."""
    loaded, why = _as_loaded(stored, config, host)
    by_name = {x.stored.name: x for x in loaded}
    c, s = stored.config, host.dtype.itemsize
    layers: dict[str, tuple[list[_Loaded], int]] = {}  # layer -> (matrices, bias values)
    vectors = 0
    for x in loaded:
        name = x.stored.name
        if name in (_EMBED, _HEAD):
            continue
        if x.kind in INTEGER_KINDS:  # a table of ids, held as stored
            vectors += x.stored.nbytes
            continue
        suffix = next((f for f in _FUSED if name.endswith(f)), None)
        key = name[: -len(suffix)] + _FUSED[suffix] if suffix else name
        parts, bias = layers.setdefault(key, ([], 0))
        if name.endswith(".bias"):
            layers[key] = (parts, bias + x.stored.numel)
        elif len(x.stored.shape) >= 2:
            parts.append(x)
        else:  # a norm: float32 where it scales by 1 + w (Gemma), else the compute dtype
            vectors += x.stored.numel * (4 if c.arch.norm_offset else s)
    linears = sum(_layer_bytes(parts, bias, host) for parts, bias in layers.values() if parts)
    vectors += sum(bias * s for parts, bias in layers.values() if not parts)
    embedding, head = _embedding_and_head(by_name, c, host)
    tables = 2 if c.rope_local_theta is not None else 1  # Gemma 3: a local and a global RoPE
    rope = tables * 2 * c.max_position_embeddings * c.head_dim * s  # cos and signed sin
    parameters = sum(x.stored.numel for x in loaded if x.stored.name != _HEAD)
    return WeightPlan(linears, embedding, head, vectors, rope, parameters, why)


def _layer_bytes(parts: Sequence[_Loaded], bias: int, host: Host) -> int:
    """One layer over ``parts`` stacked (``LinearFactory.fused``): their blocks where every
    part is native here (a float32 bias), else the dense layer over them all."""
    f = host.factory
    if all(p.blocks and _multiplies(f.quant, p.kind) for p in parts):
        return sum(p.stored.nbytes for p in parts) + 4 * bias
    k = parts[0].stored.shape[-1]
    n = sum(p.stored.numel for p in parts) // k
    return _dense_bytes(n, k, bias, host)


def _dense_bytes(n: int, k: int, bias: int, host: Host) -> int:
    """A dense layer of weights [n, k] (``LinearFactory.__call__``): Q8_0 blocks under
    ``--quantization`` where the block kernels take them, int8 panels and their scales on
    ``linear_avx2``, else the weights (packed or not) in the compute dtype."""
    f, s = host.factory, host.dtype.itemsize
    q = f.quantization
    if q is not None and f.quant is not None and k % 32 == 0 and _multiplies(f.quant, "Q8_0"):
        return n * k // 32 * GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1] + 4 * bias
    if q is not None and _kernel(f, n, k) == "widen":
        scales = n * k // 32 if q == "int8-b32" else n  # float32: per 32 inputs, or a row
        return n * k + 4 * scales + s * bias
    return (n * k + bias) * s


def _kernel(factory: LinearFactory, n: int, k: int) -> str | None:
    """The native kernel a dense layer [n, k] gets here: the factory's own choice, asked of a
    weight with no data."""
    return factory._kernel(torch.empty((n, k), device="meta"))


def _embedding_and_head(by_name: dict[str, _Loaded], c: ModelConfig, host: Host) -> tuple[int, int]:
    """(embedding, LM head) bytes (``LinearFactory.embedding`` and ``logits``)."""
    f, s = host.factory, host.dtype.itemsize
    table = by_name[_EMBED]
    vocab, hidden = table.stored.shape[0], table.stored.shape[-1]
    native_table = table.blocks and _multiplies(f.quant, table.kind)
    embedding = table.stored.nbytes if native_table else vocab * hidden * s
    tied = c.tie_word_embeddings or _HEAD not in by_name
    w = table if tied else by_name[_HEAD]
    n, k = w.stored.shape[0], w.stored.shape[-1]
    if not w.blocks and f.quantization is not None:
        # ``_as_blocks`` first, then a dense int8 layer (``_dense_bytes``'s rules)
        return embedding, _dense_bytes(n, k, 0, host)
    if w.blocks and _multiplies(f.quant, w.kind):
        return embedding, 0 if tied else w.stored.nbytes  # the same blocks, when tied
    if _kernel(f, n, k) is not None or f.onednn:
        return embedding, n * k * s  # packed panels (bf16 copies)
    # ``F.linear`` over ``weight.to(dtype)``: the embedding's own tensor when that casts
    # nothing (tied, stored dense in the compute dtype)
    shared = tied and w.dtype == host.dtype
    return embedding, 0 if shared else n * k * s
