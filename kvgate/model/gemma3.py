"""Gemma 3 (text): its own layer and forward pass, on the shared decoder parts.

Per layer (``GEMMA3``, at the end with its config readers): x -> norm -> attention (q/k
norms, RoPE, a sliding window on most layers) -> norm -> + x; -> norm -> GeGLU MLP -> norm
-> + x. Norms scale by ``1 + w`` and compute in float32 whatever the model dtype (as HF's
Gemma3RMSNorm), so their weights are kept in float32 with the 1 added. Embeddings are scaled
by sqrt(hidden); sliding layers rotate with their own RoPE base, global ones with
``rope_theta`` (and its scaling). llama.cpp stores its norms as ``1 + w`` (undone at load).

Shapes as in ``decoder.py``: T tokens, H hidden, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.architectures import Architecture, GGUFMetadata
from kvgate.model.attention import AttentionMetadata
from kvgate.model.config import ModelConfig
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.decoder import (
    DecoderModel,
    attention_mlp_weights,
    head_weights,
    per_layer,
)
from kvgate.model.hf_loader import is_number, positive_int, read_rope
from kvgate.model.linear import Linear, Weight
from kvgate.model.lora import LoraRows, add_lora
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
    supports_lora = True

    def _setup(self, kernels: CpuKernels | None) -> None:
        """The fused element-wise kernels and the native decode layers are Llama's (SiLU,
        norms scaling in the model dtype): Gemma 3 runs its element-wise ops in PyTorch."""
        c, dtype, device = self.config, self.dtype, self.device
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
        lora: LoraRows | None = None,
    ) -> Generator[None, None, torch.Tensor]:  # [T, H]
        """As ``LlamaModel.stepwise``; a sliding layer's ``meta`` names only the blocks its
        window reaches."""
        lora = self.check_lora(lora, input_ids.shape[0])
        metas = per_layer(meta, len(self.layers))
        t, hq, hkv, d = input_ids.shape[0], *self._heads()
        tables = (self.rope.tables(positions), self.rope_local.tables(positions))
        x = self.embed(input_ids) * self.embed_scale  # [T, H]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i and pause:
                yield
            window = self.windows[i]
            cos, sin = tables[window is not None]  # sliding layers: the local RoPE
            h = self._rms(x, layer.input_norm)
            qkv = add_lora(lora, i, "qkv", h, apply(roles, layer.qkv, h))
            q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
            q = apply_rotary(self._rms(q.reshape(t, hq, d), layer.q_norm), cos, sin)
            k = apply_rotary(self._rms(k.reshape(t, hkv, d), layer.k_norm), cos, sin)
            v = v.reshape(t, hkv, d)
            self.attention.write_kv(k, v, k_cache, v_cache, metas[i])
            attn = self.attention.attend(q, k, v, k_cache, v_cache, metas[i], window)
            attn = attn.reshape(t, hq * d)
            o = add_lora(lora, i, "o", attn, apply(roles, layer.o, attn))
            x = x + self._rms(o, layer.post_norm)
            h = self._rms(x, layer.pre_ffn_norm)
            gate_up = add_lora(lora, i, "gate_up", h, apply(roles, layer.gate_up, h))
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
            mlp = add_lora(lora, i, "down", act, apply(roles, layer.down, act))
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


_GEMMA_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def gemma3_hf_fields(raw: Mapping[str, Any], file: str) -> dict[str, Any]:
    """Gemma 3's own keys (transformers v4 and v5 spellings): activation, layer types and
    window, local and global RoPE, attention scale, soft-capping. ``rope``: (theta, scaling)
    of the global layers."""
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModel(
            f"{file}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)", path=file
        )
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise UnsupportedModel(f"{file}: {key} is not supported", path=file)
    layers = positive_int(raw, "num_hidden_layers", file)
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or pattern <= 0:
            raise CorruptWeights(f"{file}: sliding_window_pattern must be positive", path=file)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list) or any(t not in _GEMMA_LAYER_TYPES for t in types):
        raise UnsupportedModel(
            f"{file}: layer_types must list 'sliding_attention' or 'full_attention'", path=file
        )
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:  # v5: per layer type
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        rope = read_rope({"rope_parameters": full, "rope_theta": full.get("rope_theta", 1e6)}, file)
        local_theta = local.get("rope_theta", 10000.0)
    else:
        rope = read_rope({**raw, "rope_theta": raw.get("rope_theta", 1e6)}, file)
        local_theta = raw.get("rope_local_base_freq", 10000.0)
    scalar = raw.get("query_pre_attn_scalar", raw.get("head_dim"))
    cap = raw.get("final_logit_softcapping")
    for key, value in (("rope_local_base_freq", local_theta), ("query_pre_attn_scalar", scalar)):
        if not is_number(value) or value <= 0:
            raise CorruptWeights(f"{file}: {key} must be a positive number", path=file)
    if cap is not None and (not is_number(cap) or cap <= 0):
        raise CorruptWeights(f"{file}: final_logit_softcapping must be positive", path=file)
    return {
        "rope": rope,
        "layer_types": tuple(_GEMMA_LAYER_TYPES[t] for t in types),
        "sliding_window": raw.get("sliding_window"),
        "rope_local_theta": float(local_theta),
        "attention_scale": float(scalar) ** -0.5,
        "hidden_act": "gelu_tanh",
        "final_logit_softcapping": None if cap is None else float(cap),
    }


def gemma3_gguf_fields(f: GGUFMetadata, arch: str, num_layers: int) -> dict[str, Any]:
    """Gemma 3's sliding-window layout and constants. llama.cpp writes the window but not
    which layers use it, nor the local RoPE base: its loader hard-codes both (every sixth layer
    global, base 10k locally), and so do transformers' defaults; files that state them win."""
    pattern = f.pos_int(f"{arch}.attention.sliding_window_pattern", 6)
    return {
        "layer_types": tuple(
            "full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)
        ),
        "sliding_window": f.pos_int(f"{arch}.attention.sliding_window"),
        "rope_local_theta": f.pos_f32(f"{arch}.rope.freq_base_swa", 10000.0),
        "hidden_act": "gelu_tanh",
        "final_logit_softcapping": f.opt_pos_float(f"{arch}.final_logit_softcapping"),
        # llama.cpp's general key; absent (as Gemma 3's converter leaves it), 1/sqrt(head_dim).
        "attention_scale": f.opt_pos_float(f"{arch}.attention.scale"),
    }


def gemma3_export_hf(c: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers' Gemma 3 reads it."""
    names = {"sliding": "sliding_attention", "full": "full_attention"}
    out = {k: v for k, v in hf.items() if k not in ("hidden_act", "attention_bias")}
    out.update(
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": [names[t] for t in c.layer_types],
            "sliding_window": c.sliding_window,
            "rope_local_base_freq": c.rope_local_theta,
            "query_pre_attn_scalar": round((c.attention_scale or c.head_dim**-0.5) ** -2),
            "final_logit_softcapping": c.final_logit_softcapping,
            "attn_logit_softcapping": None,
        }
    )
    return out


def gemma3_weights(
    arch: Architecture, config: ModelConfig
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight ``Gemma3Model._layer`` reads, HF names."""
    h, d = (config.hidden_size,), (config.head_dim,)
    yield "model.embed_tokens.weight", (config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        yield from attention_mlp_weights(config, p, qkv_bias=False)
        yield p + "self_attn.q_norm.weight", d
        yield p + "self_attn.k_norm.weight", d
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            yield p + f"{norm}_layernorm.weight", h
    yield from head_weights(config)


# Gemma's turn format (a system message opens the first user turn, as Gemma's own template does).
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (m['content'] | trim) + '\\n\\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{%- if m['role'] != 'assistant' %}{{ ns.system }}{% set ns.system = '' %}{% endif -%}"
    "{{ (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"
)

GEMMA3 = Architecture(
    "gemma3",
    ("gemma3_text",),
    "gemma3",
    "Gemma3ForCausalLM",
    Gemma3Model,
    gemma3_weights,
    qk_norm=True,
    norm_offset=1.0,
    gguf_layer_names={
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    end_of_turn="<end_of_turn>",
    default_chat_template=_GEMMA_TEMPLATE,
    hf_fields=gemma3_hf_fields,
    gguf_fields=gemma3_gguf_fields,
    export_hf=gemma3_export_hf,
)
ARCHITECTURES = (GEMMA3,)
