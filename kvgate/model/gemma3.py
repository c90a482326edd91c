"""Gemma 3 (text): the Llama forward pass's weights and kernels, with Gemma's layer.

Per layer (``architectures.GEMMA3``): x -> norm -> attention (q/k norms, RoPE, a sliding
window on most layers) -> norm -> + x; -> norm -> GeGLU MLP -> norm -> + x. Norms scale by
``1 + w`` and compute in float32 whatever the model dtype (as HF's Gemma3RMSNorm), so their
weights are kept in float32 with the 1 added. Embeddings are scaled by sqrt(hidden); sliding
layers rotate with their own RoPE base, global ones with ``rope_theta`` (and its scaling).

Shapes as in ``llama.py``: T tokens, H hidden, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

import torch
import torch.nn.functional as F

from kvgate.model.attention import AttentionMetadata
from kvgate.model.cpu_kernels import KernelLibrary
from kvgate.model.linear import Weight
from kvgate.model.llama import LayerWeights, LlamaModel, per_layer
from kvgate.model.native_decode import NativeDecode
from kvgate.model.ops import LayerOps, TorchLayerOps
from kvgate.model.rope import RotaryEmbedding, apply_rotary
from kvgate.model.row_roles import RowRoles, apply


class Gemma3Model(LlamaModel):
    def _setup(self) -> None:
        c = self.config
        local_theta = c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta
        self.rope_local = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, local_theta, None, self.dtype, self.device
        )
        self.windows = [c.layer_window(i) for i in range(c.num_layers)]
        # HF: embed(ids) * tensor(sqrt(hidden), float32).to(dtype).
        self.embed_scale = torch.tensor(c.hidden_size**0.5).to(self.dtype)

    def _norm(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        w = self._vector(weights, name, shape).to(device=self.device, dtype=torch.float32)
        return (1.0 + w).contiguous()

    def _layer(self, weights: Mapping[str, Weight], i: int) -> LayerWeights:
        layer = super()._layer(weights, i)
        p, h = f"model.layers.{i}.", (self.config.hidden_size,)
        layer.pre_ffn_norm = self._norm(weights, p + "pre_feedforward_layernorm.weight", h)
        layer.post_ffn_norm = self._norm(weights, p + "post_feedforward_layernorm.weight", h)
        return layer

    def _layer_ops(self, lib: KernelLibrary | None) -> LayerOps:
        # The fused element-wise kernels are Llama's (SiLU, norms scaling in the model dtype).
        heads = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim)
        return TorchLayerOps(self.rope, self.attention, heads)

    def _native_decode(self, level: str) -> NativeDecode | None:
        return None

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
            assert layer.q_norm is not None and layer.k_norm is not None
            q = apply_rotary(self._rms(q.reshape(t, hq, d), layer.q_norm), cos, sin)
            k = apply_rotary(self._rms(k.reshape(t, hkv, d), layer.k_norm), cos, sin)
            v = v.reshape(t, hkv, d)
            self.attention.write_kv(k, v, k_cache, v_cache, metas[i])
            attn = self.attention.attend(q, k, v, k_cache, v_cache, metas[i], window)
            x = x + self._rms(apply(roles, layer.o, attn.reshape(t, hq * d)), layer.post_norm)
            assert layer.pre_ffn_norm is not None and layer.post_ffn_norm is not None
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
