"""Gemma 3 (text): its own layer and forward pass, on the shared decoder parts.

Per layer (``architectures.GEMMA3``): x -> norm -> attention (q/k norms, RoPE, a sliding
window on most layers) -> norm -> + x; -> norm -> GeGLU MLP -> norm -> + x. Norms scale by
``1 + w`` and compute in float32 whatever the model dtype (as HF's Gemma3RMSNorm), so their
weights are kept in float32 with the 1 added. Embeddings are scaled by sqrt(hidden); sliding
layers rotate with their own RoPE base, global ones with ``rope_theta`` (and its scaling).

Shapes as in ``llama.py``: T tokens, H hidden, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgate.model.attention import AttentionBackend, AttentionMetadata
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.decoder import DecoderModel, per_layer
from kvgate.model.linear import Linear, Weight
from kvgate.model.rope import RotaryEmbedding, apply_rotary
from kvgate.model.row_roles import RowRoles, apply


@dataclass(frozen=True)
class Gemma3Layer:
    input_norm: torch.Tensor  # [H] float32, 1 + w
    qkv: Linear  # H -> (Hq + 2 Hkv) D
    q_norm: torch.Tensor  # [D] float32, 1 + w: per-head RMSNorm of q, before RoPE
    k_norm: torch.Tensor  # [D]: the same for k
    o: Linear  # Hq D -> H
    post_norm: torch.Tensor  # [H]: after attention, before the residual add
    pre_ffn_norm: torch.Tensor  # [H]: before the MLP ...
    gate_up: Linear  # H -> 2 I: gate and up fused
    down: Linear  # I -> H
    post_ffn_norm: torch.Tensor  # [H]: ... and after it


class Gemma3Model(DecoderModel[Gemma3Layer]):
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
        """The fused element-wise kernels and the native decode layers are Llama's (SiLU,
        norms scaling in the model dtype): Gemma 3 runs its element-wise ops in PyTorch."""
        super().__init__(
            config,
            weights,
            dtype=dtype,
            device=device,
            attention=attention,
            source=source,
            kernels=kernels,
            quantization=quantization,
        )
        c = config
        self.rope = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype, device
        )
        local_theta = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
        self.rope_local = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, local_theta, None, dtype, device
        )
        self.windows = [c.layer_window(i) for i in range(c.num_layers)]
        # HF: embed(ids) * tensor(sqrt(hidden), float32).to(dtype).
        self.embed_scale = torch.tensor(c.hidden_size**0.5).to(dtype)

    def _norm(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        w = self._vector(weights, name, shape).to(device=self.device, dtype=torch.float32)
        return (1.0 + w).contiguous()

    def _layer(self, weights: Mapping[str, Weight], i: int) -> Gemma3Layer:
        p, h, d = f"model.layers.{i}.", (self.config.hidden_size,), (self.config.head_dim,)
        lin = self._attention_mlp(weights, p, qkv_bias=False)
        return Gemma3Layer(
            input_norm=self._norm(weights, p + "input_layernorm.weight", h),
            qkv=lin.qkv,
            q_norm=self._norm(weights, p + "self_attn.q_norm.weight", d),
            k_norm=self._norm(weights, p + "self_attn.k_norm.weight", d),
            o=lin.o,
            post_norm=self._norm(weights, p + "post_attention_layernorm.weight", h),
            pre_ffn_norm=self._norm(weights, p + "pre_feedforward_layernorm.weight", h),
            gate_up=lin.gate_up,
            down=lin.down,
            post_ffn_norm=self._norm(weights, p + "post_feedforward_layernorm.weight", h),
        )

    def _layer_linears(self, layer: Gemma3Layer) -> Iterator[Linear]:
        yield from (layer.qkv, layer.o, layer.gate_up, layer.down)

    def _layer_norms(self, layer: Gemma3Layer) -> Iterator[torch.Tensor]:
        yield from (layer.input_norm, layer.post_norm, layer.pre_ffn_norm, layer.post_ffn_norm)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma3RMSNorm: in float32, scaled by (1 + w) (``weight`` holds it), cast back."""
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (out * weight).to(x.dtype)

    @torch.inference_mode()  # entered and left around each resumption of the generator
    def stepwise(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        pause: bool,
        roles: RowRoles | None = None,
    ) -> Generator[None, None, torch.Tensor]:  # [T, H]
        """As ``LlamaModel.stepwise``; a sliding layer's ``meta`` names only the blocks its
        window reaches."""
        metas = per_layer(meta, len(self.layers))
        t, hq, hkv, d = input_ids.shape[0], *self._heads()
        tables = (self.rope.tables(positions), self.rope_local.tables(positions))
        x = self.embed(input_ids) * self.embed_scale  # [T, H]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i and pause:
                yield
            window = self.windows[i]
            cos, sin = tables[window is not None]  # sliding layers: the local RoPE
            qkv = apply(roles, layer.qkv, self._rms(x, layer.input_norm))
            q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(self._rms(q.reshape(t, hq, d), layer.q_norm), cos, sin)
            k = apply_rotary(self._rms(k.reshape(t, hkv, d), layer.k_norm), cos, sin)
            v = v.reshape(t, hkv, d)
            self.attention.write_kv(k, v, k_cache, v_cache, metas[i])
            attn = self.attention.attend(q, k, v, k_cache, v_cache, metas[i], window)
            x = x + self._rms(apply(roles, layer.o, attn.reshape(t, hq * d)), layer.post_norm)
            gate_up = apply(roles, layer.gate_up, self._rms(x, layer.pre_ffn_norm))
            gate, up = gate_up.chunk(2, dim=-1)
            mlp = apply(roles, layer.down, F.gelu(gate, approximate="tanh") * up)
            x = x + self._rms(mlp, layer.post_ffn_norm)
        return self._rms(x, self.final_norm)

    def _heads(self) -> tuple[int, int, int]:
        return self.config.num_heads, self.config.num_kv_heads, self.config.head_dim

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
