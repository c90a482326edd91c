"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2, Qwen3: ``architectures.py``) reading
and writing KV through blocks.

Plain tensors and functions rather than nn.Modules: the forward is short enough to read in one
go, and there is no training. Shapes: T = tokens in the flat batch, H = hidden size,
Hq / Hkv = query / KV heads, D = head dim, I = intermediate size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvgate.errors import CorruptWeights
from kvgate.model.attention import AttentionBackend, AttentionMetadata, TorchAttention
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import CpuKernels, KernelLibrary
from kvgate.model.kv_spec import KVSpec
from kvgate.model.linear import Linear, LinearFactory, Weight
from kvgate.model.native_decode import NativeDecode
from kvgate.model.ops import FusedCpuLayerOps, LayerOps, TorchLayerOps
from kvgate.model.rope import RotaryEmbedding
from kvgate.model.row_roles import RowRoles, apply


def drive(layers: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """Drive a ``stepwise`` generator to its end; its hidden states."""
    while True:
        try:
            next(layers)
        except StopIteration as done:
            hidden: torch.Tensor = done.value
            return hidden


def per_layer(
    meta: AttentionMetadata | Sequence[AttentionMetadata], num_layers: int
) -> Sequence[AttentionMetadata]:
    if isinstance(meta, AttentionMetadata):
        return [meta] * num_layers
    if len(meta) != num_layers:
        raise ValueError(f"{len(meta)} attention descriptions for {num_layers} layers")
    return meta


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> (Hq + 2 Hkv) D: q, k and v fused into one matmul (+ bias for Qwen2)
    o: Linear  # Hq D -> H
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I: gate and up fused
    down: Linear  # I -> H
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's per-head RMSNorm of q, before RoPE
    k_norm: torch.Tensor | None = None  # [D]: the same for k
    pre_ffn_norm: torch.Tensor | None = None  # [H]: Gemma's norm before the MLP ...
    post_ffn_norm: torch.Tensor | None = None  # [H]: ... and after it


class LlamaModel:
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
        self.layers = [self._layer(weights, i) for i in range(c.num_layers)]
        self.rope = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype, device
        )
        self.ops = self._layer_ops(kernels.elementwise if kernels else None)
        self.native_decode = self._native_decode(kernels.level) if kernels else None
        #: Whether prompt tokens take other linears than generated ones (``row_roles``).
        self.prompt_tiles = any(
            getattr(lin, "prompt_tiles", False)
            for layer in self.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        self._setup()

    def _setup(self) -> None:
        """What a subclass's forward pass needs beyond the weights (called last in init)."""

    def _layer_ops(self, lib: KernelLibrary | None) -> LayerOps:
        heads = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim)
        torch_ops = TorchLayerOps(self.rope, self.attention, heads)
        # The fused kernels are bf16-only; they write the KV cache in place only where the
        # attention backend says its layout allows it (`native_layout`).
        if lib is None or self.dtype != torch.bfloat16 or self.device.type != "cpu":
            return torch_ops
        return FusedCpuLayerOps(lib, self.rope, heads, torch_ops)

    def _native_decode(self, level: str) -> NativeDecode | None:
        if self.dtype != torch.bfloat16 or self.config.qk_norm:  # no q/k norm in the C layer
            return None
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        layers = [
            ((w.qkv, w.o, w.gate_up, w.down), w.post_norm, next_norm)
            for w, next_norm in zip(self.layers, next_norms, strict=True)
        ]
        return NativeDecode.build(self.config, layers, self.ops, self.attention, level)

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

    def _norm(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A norm's weight as the forward pass multiplies by it."""
        return self._take(weights, name, shape)

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

    def _layer(self, weights: Mapping[str, Weight], i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        h = c.hidden_size
        # Linear weights as loaded: the factory casts (or quantizes) them.
        q = self._raw(weights, p + "self_attn.q_proj.weight", (self.q_size, h))
        k = self._raw(weights, p + "self_attn.k_proj.weight", (self.kv_size, h))
        v = self._raw(weights, p + "self_attn.v_proj.weight", (self.kv_size, h))
        bias = None
        if c.attention_bias:
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
        return LayerWeights(
            input_norm=self._norm(weights, p + "input_layernorm.weight", (h,)),
            qkv=self.linear.fused([q, k, v], bias),
            o=self.linear(o, None),
            post_norm=self._norm(weights, p + "post_attention_layernorm.weight", (h,)),
            gate_up=self.linear.fused([gate, up], None),
            down=self.linear(down, None),
            q_norm=self._norm(weights, p + "self_attn.q_norm.weight", (c.head_dim,))
            if c.qk_norm
            else None,
            k_norm=self._norm(weights, p + "self_attn.k_norm.weight", (c.head_dim,))
            if c.qk_norm
            else None,
        )

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
        linears: list[Linear] = [self.lm_head]
        for layer in self.layers:
            linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
        norms = (
            self.config.hidden_size * (2 * len(self.layers) + 1) * self.final_norm.element_size()
        )
        return sum(lin.weight_bytes() for lin in linears) + norms

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        roles: RowRoles | None = None,
    ) -> torch.Tensor:  # [T, H]
        """One step over the flat batch, all layers at once; returns final-normed hidden
        states. ``meta``: the step's attention description, or one per layer."""
        return drive(self.stepwise(input_ids, positions, kv_caches, meta, False, roles))

    @torch.inference_mode()  # entered and left around each resumption of the generator
    def stepwise(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        pause: bool,
        roles: RowRoles | None = None,
    ) -> Generator[None, None, torch.Tensor]:
        """The same step as a generator that, with ``pause``, stops after every layer but the
        last: whoever drives it (the engine's step) may run a whole other step there (an
        urgent prefill, for other sequences) before resuming this one. Its value is the
        final-normed hidden states [T, H]. The model never calls back into the engine.
        ``roles``: the step's prompt rows, where ``prompt_tiles`` (None: no prompt row)."""
        metas = per_layer(meta, len(self.layers))
        meta = metas[0]  # every layer's: Llama-family layers attend to the whole context
        eps = self.config.rms_norm_eps
        ops = self.ops
        residual = self.embed(input_ids)  # [T, H]; updated in place below
        h = ops.add_norm(None, residual, self.layers[0].input_norm, eps)
        native = self.native_decode
        if native is not None and roles is None and native.applies(kv_caches, meta):
            # Decodes only: whole layers per native call, the same kernels in the same order.
            step = native.start(positions, residual, h, meta)
            if not pause:
                native.run(step, 0, len(self.layers))
            else:
                for i in range(len(self.layers)):
                    if i:
                        yield
                    native.run(step, i, i + 1)
            return h
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i and pause:
                yield
            qkv = apply(roles, layer.qkv, h)
            if layer.q_norm is not None and layer.k_norm is not None:
                self._norm_heads(qkv, layer.q_norm, layer.k_norm)
            q, k, v = ops.rope_write_kv(qkv, positions, k_cache, v_cache, meta)
            attn = self.attention.attend(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D]
            o = apply(roles, layer.o, attn.reshape(-1, self.q_size))
            h = ops.add_norm(o, residual, layer.post_norm, eps)
            mlp = apply(roles, layer.down, ops.silu_mul(apply(roles, layer.gate_up, h)))
            # The next layer's input norm (or the final norm) shares this residual add.
            next_norm = (
                self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            )
            h = ops.add_norm(mlp, residual, next_norm, eps)
        return h

    def _norm_heads(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> None:
        """Qwen3: RMSNorm over each q and k head (in float32, as HF computes it), in place in
        the fused projection's output ``qkv`` [T, (Hq + 2 Hkv) D]."""
        d, eps = self.config.head_dim, self.config.rms_norm_eps
        for part, weight in ((slice(0, self.q_size), q_norm),
                             (slice(self.q_size, self.q_size + self.kv_size), k_norm)):  # fmt: skip
            heads = qkv[:, part].reshape(qkv.shape[0], -1, d)  # [T, heads, D]
            x = heads.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            qkv[:, part] = (weight * x.to(qkv.dtype)).flatten(1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in float32 (``LinearFactory.logits``). The head
        takes no roles: it sees one row a sequence, where bf16 tiles would cost four times
        the int8 product, and every row of it takes the same product in any step."""
        return self.lm_head(hidden)
