"""What every decoder model class shares, whatever its layers: reading and checking its
weights, the linear-layer factory, the embedding, the final norm and the LM head, the
parameter count, the bytes a decode step reads and the build info. Each architecture's module
subclasses it with its own layers and forward pass (``llama.py``, ``gemma3.py``); no model
class subclasses another's.

Shapes: T = tokens in the flat batch, H = hidden size, Hq / Hkv = query / KV heads, D = head
dim, I = intermediate size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kvgate.errors import CorruptWeights, InvalidConfig
from kvgate.model.attention import AttentionBackend, AttentionMetadata, TorchAttention
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.kv_spec import KVSpec
from kvgate.model.linear import Linear, LinearFactory, Weight
from kvgate.model.lora import PARAM as LORA_PARAM
from kvgate.model.lora import LoraRows
from kvgate.model.native_decode import NativeDecode
from kvgate.model.ops import FusedCpuLayerOps, LayerOps
from kvgate.model.row_roles import RowRoles


def drive(layers: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """Drive a ``stepwise`` generator to its end; its hidden states."""
    while True:
        try:
            next(layers)
        except StopIteration as done:
            hidden: torch.Tensor = done.value
            return hidden


def attention_mlp_weights(
    config: ModelConfig, p: str, qkv_bias: bool
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The weights ``DecoderModel._attention_mlp`` reads for layer ``p``, and their shapes."""
    h, hd = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_heads * hd, config.num_kv_heads * hd
    inter = config.intermediate_size
    yield p + "self_attn.q_proj.weight", (q_dim, h)
    yield p + "self_attn.k_proj.weight", (kv_dim, h)
    yield p + "self_attn.v_proj.weight", (kv_dim, h)
    yield p + "self_attn.o_proj.weight", (h, q_dim)
    if qkv_bias:
        yield p + "self_attn.q_proj.bias", (q_dim,)
        yield p + "self_attn.k_proj.bias", (kv_dim,)
        yield p + "self_attn.v_proj.bias", (kv_dim,)
    yield p + "mlp.gate_proj.weight", (inter, h)
    yield p + "mlp.up_proj.weight", (inter, h)
    yield p + "mlp.down_proj.weight", (h, inter)


def head_weights(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The final norm and, untied, the LM head."""
    yield "model.norm.weight", (config.hidden_size,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, config.hidden_size)


def per_layer(
    meta: AttentionMetadata | Sequence[AttentionMetadata], num_layers: int
) -> Sequence[AttentionMetadata]:
    if isinstance(meta, AttentionMetadata):
        return [meta] * num_layers
    if len(meta) != num_layers:
        raise ValueError(f"{len(meta)} attention descriptions for {num_layers} layers")
    return meta


@dataclass(frozen=True)
class AttentionMlp:
    """The linears of an attention block and a gated MLP, as most layers have them."""

    qkv: Linear  # H -> (Hq + 2 Hkv) D: q, k and v fused into one matmul (+ biases)
    o: Linear  # Hq D -> H
    gate_up: Linear  # H -> 2 I: gate and up fused
    down: Linear  # I -> H

    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


Layer = TypeVar("Layer")


class DecoderModel(Generic[Layer]):
    """The shared part of a model class (see the module docstring). A subclass reads its
    layers (``_layer``), lists what a decode step reads of them (``_layer_linears``,
    ``_layer_norms``), and runs them (``stepwise``)."""

    #: The per-op paths ``build_info`` reports; a subclass sets them where they differ.
    ops: LayerOps | None = None
    native_decode: NativeDecode | None = None
    #: Whether its ``stepwise`` takes ``lora`` (per-request LoRA adapters, ``lora.py``).
    supports_lora: bool = False

    @staticmethod
    def kv_specs(config: ModelConfig) -> tuple[KVSpec, ...]:
        """Each layer's KV pages (``kv_spec.py``): K and V of ``head_dim`` per KV head, read
        over the layer's window (every position, for a full-attention layer)."""
        return tuple(
            KVSpec.attention(config.num_kv_heads, config.head_dim, config.layer_window(i))
            for i in range(config.num_layers)
        )

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Weight],
        *,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend,
        source: str = "<weights>",
        kernels: CpuKernels | None = None,
        quantization: str | None = None,
    ) -> None:
        """``kernels``: the native CPU kernels to use where they apply (None: PyTorch only);
        ``quantization``: ``"int8"`` or ``"int8-b32"`` for weight-only int8 linear layers
        (see ``linear.py``)."""
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention = attention
        self._source = source
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.linear = LinearFactory.for_device(
            dtype,
            device,
            kernels.linear if kernels else None,
            quantization,
            quant=kernels.quant if kernels else None,
        )
        self._num_params = 0
        embed = self._raw(weights, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.embed = self.linear.embedding(embed)  # ids [T] -> [T, H]
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            lm_head = embed
        else:
            lm_head = self._raw(weights, "lm_head.weight", (c.vocab_size, c.hidden_size))
        self.lm_head = self.linear.logits(lm_head)
        self.final_norm = self._norm(weights, "model.norm.weight", (c.hidden_size,))
        self.layers: list[Layer] = [self._layer(weights, i) for i in range(c.num_layers)]
        #: Whether prompt tokens take other linears than generated ones (``row_roles``).
        self.prompt_tiles = any(
            getattr(lin, "prompt_tiles", False)
            for layer in self.layers
            for lin in self._layer_linears(layer)
        )
        self._setup(kernels)

    # ------------------------------------------------------------------ what a subclass has
    def _setup(self, kernels: CpuKernels | None) -> None:
        """What its forward pass needs beyond the weights (RoPE tables, fused ops); called
        last in ``__init__``, with the kernels it was given."""

    def _layer(self, weights: Mapping[str, Weight], i: int) -> Layer:
        raise NotImplementedError

    def _layer_linears(self, layer: Layer) -> Iterator[Linear]:
        raise NotImplementedError

    def _layer_norms(self, layer: Layer) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def stepwise(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        pause: bool,
        roles: RowRoles | None = None,
    ) -> Generator[None, None, torch.Tensor]:
        """One step over the flat batch as a generator that, with ``pause``, stops after every
        layer but the last: whoever drives it (the engine loop) may run a whole other step
        there before resuming this one. Its value is the final-normed hidden states [T, H].
        The model never calls back into the engine. ``roles``: the step's prompt rows, where
        ``prompt_tiles`` (None: no prompt row)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        roles: RowRoles | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:  # [T, H]
        """One step over the flat batch, all layers at once; returns final-normed hidden
        states. ``meta``: the step's attention description, or one per layer; ``lora``: the
        rows' LoRA adapters (refused where the class has no ``supports_lora``)."""
        if self.check_lora(lora, input_ids.shape[0]) is None:
            return drive(self.stepwise(input_ids, positions, kv_caches, meta, False, roles))
        # Only a class that supports LoRA gets here, and its stepwise takes ``lora``.
        stepwise: Callable[..., Generator[None, None, torch.Tensor]] = self.stepwise
        return drive(stepwise(input_ids, positions, kv_caches, meta, False, roles, lora=lora))

    def check_lora(self, lora: LoraRows | None, num_rows: int) -> LoraRows | None:
        """``lora`` where it gives any row an adapter, else None; ``InvalidConfig`` where
        this model class cannot apply adapters (the server checks ``supports_lora`` at
        load)."""
        if lora is None or not lora.groups:
            return None
        if not self.supports_lora:
            raise InvalidConfig(
                f"{type(self).__name__} ({self.config.architecture}) does not support LoRA "
                "adapters",
                param=LORA_PARAM,
            )
        if lora.num_rows != num_rows:
            raise ValueError(f"LoRA rows for {lora.num_rows} tokens in a step of {num_rows}")
        return lora

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in float32 (``LinearFactory.logits``). The head
        takes no roles: it sees one row a sequence, where bf16 tiles would cost four times
        the int8 product, and every row of it takes the same product in any step."""
        return self.lm_head(hidden)

    def build_info(self, isa: str) -> dict[str, str]:
        """What runs each op of this model: ``isa`` (the level the kernels were built for),
        then per op the kernel's vector path or ``torch``; ``decode``: ``layers-<isa>`` where
        decode steps run whole layers per native call, else ``per-op``; ``prompt_linear``:
        ``bf16-tiles`` where prompt tokens' block-format linears run on bf16 tiles."""
        attention = (
            self.attention.decode_kernel if isinstance(self.attention, TorchAttention) else None
        )
        return {
            "isa": isa,
            "dtype": str(self.dtype).removeprefix("torch."),
            "linear": self.linear.path,
            "attention": attention.isa if attention is not None else "torch",
            "elementwise": self.ops.isa if isinstance(self.ops, FusedCpuLayerOps) else "torch",
            "decode": f"layers-{native.isa}" if (native := self.native_decode) else "per-op",
            # prompt tokens' linears, where they differ from the others' (``row_roles``)
            "prompt_linear": "bf16-tiles" if self.prompt_tiles else self.linear.path,
        }

    def num_parameters(self) -> int:
        """Parameters as loaded (a tied LM head counts once)."""
        return self._num_params

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every linear layer (the LM head included,
        int8 where quantized) and the norms; of the embedding table only one row a token."""
        linears = [self.lm_head, *(lin for w in self.layers for lin in self._layer_linears(w))]
        norms = [self.final_norm, *(n for w in self.layers for n in self._layer_norms(w))]
        return sum(lin.weight_bytes() for lin in linears) + sum(
            n.numel() * n.element_size() for n in norms
        )

    # ------------------------------------------------------------------ reading weights
    def _attention_mlp(self, weights: Mapping[str, Weight], p: str, qkv_bias: bool) -> AttentionMlp:
        """Layer ``p``'s q/k/v/o projections (with q/k/v biases) and gated MLP, by their HF
        names; the factory casts (or quantizes, or keeps in blocks) them."""
        c, h = self.config, self.config.hidden_size
        q = self._raw(weights, p + "self_attn.q_proj.weight", (self.q_size, h))
        k = self._raw(weights, p + "self_attn.k_proj.weight", (self.kv_size, h))
        v = self._raw(weights, p + "self_attn.v_proj.weight", (self.kv_size, h))
        bias = None
        if qkv_bias:
            bias = torch.cat(
                [
                    self._vector(weights, p + "self_attn.q_proj.bias", (self.q_size,)),
                    self._vector(weights, p + "self_attn.k_proj.bias", (self.kv_size,)),
                    self._vector(weights, p + "self_attn.v_proj.bias", (self.kv_size,)),
                ]
            )
        gate = self._raw(weights, p + "mlp.gate_proj.weight", (c.intermediate_size, h))
        up = self._raw(weights, p + "mlp.up_proj.weight", (c.intermediate_size, h))
        o = self._raw(weights, p + "self_attn.o_proj.weight", (h, self.q_size))
        down = self._raw(weights, p + "mlp.down_proj.weight", (h, c.intermediate_size))
        return AttentionMlp(
            qkv=self.linear.fused([q, k, v], bias),
            o=self.linear(o, None),
            gate_up=self.linear.fused([gate, up], None),
            down=self.linear(down, None),
        )

    def _norm(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A norm's weight as the forward pass multiplies by it."""
        return self._take(weights, name, shape)

    def _take(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        return self._cast(self._vector(weights, name, shape))

    def _vector(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A 1-D weight as loaded (a bias): never kept in blocks."""
        w = self._raw(weights, name, shape)
        return w if isinstance(w, torch.Tensor) else w.dequantize()

    def _cast(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def _raw(self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]) -> Weight:
        """The tensor as loaded (float32 for a dequantized GGUF, or its blocks), shape
        checked; counted."""
        w = weights.get(name)
        if w is None:
            raise CorruptWeights(f"missing tensor {name!r} in {self._source}", path=self._source)
        if tuple(w.shape) != shape:
            raise CorruptWeights(
                f"tensor {name!r} in {self._source} has shape {tuple(w.shape)}, expected {shape}",
                path=self._source,
            )
        if not name.endswith("lm_head.weight"):
            self._num_params += w.numel()
        return w
