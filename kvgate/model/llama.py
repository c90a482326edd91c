"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2, Qwen3; their records are at the end)
reading and writing KV through blocks.

- Llama (and Mistral, SmolLM): the core. llama.cpp stores its Q/K rows permuted.
- Qwen2 / Qwen2.5: biases on the q, k and v projections.
- Qwen3: a per-head RMSNorm on q and on k (over the head dimension) before RoPE; no biases.

Plain tensors and functions rather than nn.Modules: the forward is short enough to read in one
go, and there is no training. Shapes: T = tokens in the flat batch, H = hidden size,
Hq / Hkv = query / KV heads, D = head dim, I = intermediate size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvgate.model.architectures import Architecture
from kvgate.model.attention import AttentionMetadata
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import CpuKernels, KernelLibrary
from kvgate.model.decoder import (
    DecoderModel,
    attention_mlp_weights,
    head_weights,
    per_layer,
)
from kvgate.model.kv_codec import KVCodec, key_offset
from kvgate.model.linear import Linear, Weight
from kvgate.model.lora import LoraRows, add_lora
from kvgate.model.native_decode import NativeDecode
from kvgate.model.ops import FusedCpuLayerOps, LayerOps, TorchLayerOps
from kvgate.model.rope import RotaryEmbedding, inverse_frequencies
from kvgate.model.row_roles import RowRoles, apply


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
    #: [Hkv, D] float32 that quantized keys are stored less (``kv_codec.key_offset``)
    key_offset: torch.Tensor | None = None


class LlamaModel(DecoderModel[LayerWeights]):
    ops: LayerOps
    supports_lora = True

    def _setup(self, kernels: CpuKernels | None) -> None:
        c = self.config
        self.rope = RotaryEmbedding(
            c.head_dim,
            c.max_position_embeddings,
            c.rope_theta,
            c.rope_scaling,
            self.dtype,
            self.device,
        )
        self.ops = self._layer_ops(kernels.elementwise if kernels else None)
        self.native_decode = self._native_decode(kernels.level) if kernels else None

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
            ((w.qkv, w.o, w.gate_up, w.down), w.post_norm, next_norm, w.key_offset)
            for w, next_norm in zip(self.layers, next_norms, strict=True)
        ]
        return NativeDecode.build(self.config, layers, self.ops, self.attention, level)

    def _layer(self, weights: Mapping[str, Weight], i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        h = c.hidden_size
        lin = self._attention_mlp(weights, p, c.attention_bias)
        return LayerWeights(
            input_norm=self._norm(weights, p + "input_layernorm.weight", (h,)),
            qkv=lin.qkv,
            o=lin.o,
            post_norm=self._norm(weights, p + "post_attention_layernorm.weight", (h,)),
            gate_up=lin.gate_up,
            down=lin.down,
            q_norm=self._norm(weights, p + "self_attn.q_norm.weight", (c.head_dim,))
            if c.qk_norm
            else None,
            k_norm=self._norm(weights, p + "self_attn.k_norm.weight", (c.head_dim,))
            if c.qk_norm
            else None,
            key_offset=self._key_offset(weights, p) if c.attention_bias else None,
        )

    def _key_offset(self, weights: Mapping[str, Weight], p: str) -> torch.Tensor | None:
        """Layer ``p``'s ``kv_codec.key_offset`` where its K/V are stored quantized."""
        codec = getattr(self.attention, "codec", None)
        if not isinstance(codec, KVCodec) or not codec.scaled:
            return None
        c = self.config
        raw = weights[p + "self_attn.k_proj.bias"]  # shape checked (and counted) already
        bias = raw if isinstance(raw, torch.Tensor) else raw.dequantize()
        inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        offset = key_offset(bias, inv_freq, c.max_position_embeddings)
        return None if offset is None else offset.to(self.device)

    def _layer_linears(self, layer: LayerWeights) -> Iterator[Linear]:
        yield from (layer.qkv, layer.o, layer.gate_up, layer.down)

    def _layer_norms(self, layer: LayerWeights) -> Iterator[torch.Tensor]:
        yield from (layer.input_norm, layer.post_norm)

    @torch.inference_mode()  # entered and left around each resumption of the generator
    def stepwise(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        pause: bool,
        roles: RowRoles | None = None,
        lora: LoraRows | None = None,
    ) -> Generator[None, None, torch.Tensor]:
        """The same step as a generator that, with ``pause``, stops after every layer but the
        last: whoever drives it (the engine's step) may run a whole other step there (an
        urgent prefill, for other sequences) before resuming this one. Its value is the
        final-normed hidden states [T, H]. The model never calls back into the engine.
        ``roles``: the step's prompt rows, where ``prompt_tiles`` (None: no prompt row);
        ``lora``: the rows' LoRA adapters, their deltas added after each linear (such a
        step runs per op: the native decode layers cannot apply them)."""
        lora = self.check_lora(lora, input_ids.shape[0])
        metas = per_layer(meta, len(self.layers))
        meta = metas[0]  # every layer's: Llama-family layers attend to the whole context
        eps = self.config.rms_norm_eps
        ops = self.ops
        residual = self.embed(input_ids)  # [T, H]; updated in place below
        h = ops.add_norm(None, residual, self.layers[0].input_norm, eps)
        native = self.native_decode if roles is None and lora is None else None
        if native is not None and native.applies(kv_caches, meta):
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
            qkv = add_lora(lora, i, "qkv", h, apply(roles, layer.qkv, h))
            if layer.q_norm is not None and layer.k_norm is not None:
                self._norm_heads(qkv, layer.q_norm, layer.k_norm)
            q, k, v = ops.rope_write_kv(qkv, positions, k_cache, v_cache, meta, layer.key_offset)
            attn = self.attention.attend(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D]
            attn = attn.reshape(-1, self.q_size)
            o = add_lora(lora, i, "o", attn, apply(roles, layer.o, attn))
            h = ops.add_norm(o, residual, layer.post_norm, eps)
            act = ops.silu_mul(add_lora(lora, i, "gate_up", h, apply(roles, layer.gate_up, h)))
            mlp = add_lora(lora, i, "down", act, apply(roles, layer.down, act))
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


def llama_weights(arch: Architecture, config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight a Llama-family forward pass reads (``LlamaModel._layer``), HF names."""
    h = config.hidden_size
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        yield from attention_mlp_weights(config, p, arch.qkv_bias)
        if arch.qk_norm:
            yield p + "self_attn.q_norm.weight", (config.head_dim,)
            yield p + "self_attn.k_norm.weight", (config.head_dim,)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield from head_weights(config)


LLAMA = Architecture(
    "llama",
    ("llama", "mistral"),
    "llama",
    "LlamaForCausalLM",
    LlamaModel,
    llama_weights,
    gguf_permutes_qk=True,
)
QWEN2 = Architecture(
    "qwen2", ("qwen2",), "qwen2", "Qwen2ForCausalLM", LlamaModel, llama_weights, qkv_bias=True
)
QWEN3 = Architecture(
    "qwen3", ("qwen3",), "qwen3", "Qwen3ForCausalLM", LlamaModel, llama_weights, qk_norm=True
)
ARCHITECTURES = (LLAMA, QWEN2, QWEN3)
