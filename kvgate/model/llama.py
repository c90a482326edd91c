"""Llama-family decoder (Llama, Qwen2, Mistral, SmolLM) reading and writing KV through blocks.

Plain tensors and functions rather than nn.Modules: the forward is short enough to read in one
go, and there is no training. Shapes: T = tokens in the flat batch, H = hidden size,
Hq / Hkv = query / KV heads, D = head dim, I = intermediate size, V = vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgate.errors import CorruptWeights
from kvgate.model.attention import AttentionBackend, AttentionMetadata
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import load_fused_ops_lib
from kvgate.model.linear import Linear, make_linear, should_pack
from kvgate.model.ops import FusedCpuLayerOps, LayerOps, TorchLayerOps
from kvgate.model.rope import RotaryEmbedding


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> (Hq + 2 Hkv) D: q, k and v fused into one matmul (+ bias for Qwen2)
    o: Linear  # Hq D -> H
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I: gate and up fused
    down: Linear  # I -> H


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend,
        source: str = "<weights>",
        fused_ops: bool = True,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention = attention
        self._source = source
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self._pack = should_pack(device, dtype)
        self._native = fused_ops  # the compiled kernels (linear, element-wise) may be used
        self._num_params = 0

        self.embed = self._take(weights, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            lm_head = self.embed
        else:
            lm_head = self._take(weights, "lm_head.weight", (c.vocab_size, c.hidden_size))
        self.lm_head = make_linear(lm_head, None, pack=self._pack, native=self._native)
        self.final_norm = self._take(weights, "model.norm.weight", (c.hidden_size,))
        self.layers = [self._layer(weights, i) for i in range(c.num_layers)]
        self.rope = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype, device
        )
        self.ops = self._layer_ops(fused_ops)

    def _layer_ops(self, fused: bool) -> LayerOps:
        heads = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim)
        # The fused kernels are bf16-only and write the CPU backend's head-major cache.
        lib = load_fused_ops_lib() if fused and self._pack else None
        torch_ops = TorchLayerOps(self.rope, self.attention, heads)
        return FusedCpuLayerOps(lib, self.rope, heads, torch_ops) if lib else torch_ops

    def _take(
        self, weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
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
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def _layer(self, weights: Mapping[str, torch.Tensor], i: int) -> LayerWeights:
        c = self.config
        p = f"model.layers.{i}."
        h = c.hidden_size
        q = self._take(weights, p + "self_attn.q_proj.weight", (self.q_size, h))
        k = self._take(weights, p + "self_attn.k_proj.weight", (self.kv_size, h))
        v = self._take(weights, p + "self_attn.v_proj.weight", (self.kv_size, h))
        bias = None
        if c.attention_bias or (p + "self_attn.q_proj.bias") in weights:
            bias = torch.cat(
                [
                    self._take(weights, p + "self_attn.q_proj.bias", (self.q_size,)),
                    self._take(weights, p + "self_attn.k_proj.bias", (self.kv_size,)),
                    self._take(weights, p + "self_attn.v_proj.bias", (self.kv_size,)),
                ]
            )
        gate = self._take(weights, p + "mlp.gate_proj.weight", (c.intermediate_size, h))
        up = self._take(weights, p + "mlp.up_proj.weight", (c.intermediate_size, h))
        o = self._take(weights, p + "self_attn.o_proj.weight", (h, self.q_size))
        down = self._take(weights, p + "mlp.down_proj.weight", (h, c.intermediate_size))
        return LayerWeights(
            input_norm=self._take(weights, p + "input_layernorm.weight", (h,)),
            qkv=make_linear(
                torch.cat([q, k, v]).contiguous(), bias, pack=self._pack, native=self._native
            ),
            o=make_linear(o, None, pack=self._pack, native=self._native),
            post_norm=self._take(weights, p + "post_attention_layernorm.weight", (h,)),
            gate_up=make_linear(
                torch.cat([gate, up]).contiguous(), None, pack=self._pack, native=self._native
            ),
            down=make_linear(down, None, pack=self._pack, native=self._native),
        )

    def num_parameters(self) -> int:
        """Parameters as loaded (a tied LM head counts once)."""
        return self._num_params

    def weight_bytes(self) -> int:
        return self.num_parameters() * self.embed.element_size()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:  # [T, H]
        """One step over the flat batch; returns final-normed hidden states.

        ``between_layers`` is called after every layer but the last: the engine may run a
        whole other step there (for other sequences) and this one then carries on.
        """
        eps = self.config.rms_norm_eps
        ops = self.ops
        residual = F.embedding(input_ids, self.embed)  # [T, H]; updated in place below
        h = ops.add_norm(None, residual, self.layers[0].input_norm, eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i and between_layers is not None:
                between_layers()
            q, k, v = ops.rope_write_kv(layer.qkv(h), positions, k_cache, v_cache, meta)
            attn = self.attention.attend(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D]
            h = ops.add_norm(layer.o(attn.reshape(-1, self.q_size)), residual, layer.post_norm, eps)
            mlp = layer.down(ops.silu_mul(layer.gate_up(h)))
            # The next layer's input norm (or the final norm) shares this residual add.
            next_norm = (
                self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            )
            h = ops.add_norm(mlp, residual, next_norm, eps)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in float32 (as HF upcasts them)."""
        return self.lm_head(hidden).float()
