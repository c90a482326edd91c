"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) over a latent KV cache, and
mixture-of-experts MLPs with shared experts after the first dense layers. Their records are
at the end, with the config readers and the weight list.

Attention (per layer). q comes from h directly (V2-Lite) or through a low-rank bottleneck
(``q_a`` -> RMSNorm -> ``q_b``), per head a no-position part of ``nope`` dims and a rotary part
of ``rope`` dims. K and V are not stored: ``kv_a`` projects h to a latent ``c`` of ``C`` dims
(RMS-normed) and one rotary key ``k_pe`` shared by every head; the pool keeps [c, k_pe] per
token (a ``latent`` KV spec, ``C + rope`` values, against ``2 Hkv D`` for plain attention).
``kv_b`` would expand c to each head's no-position key and value; it is absorbed instead:
q_nope goes through ``W_UK`` into the latent space, so every head attends over the cached
latents as one KV head (scores = q_lat . c + q_pe . k_pe), and the output, a mix of latents,
goes through ``W_UV`` to each head's value, then ``o``. The same arithmetic in another order
than transformers' (it expands c for every cached token), so outputs agree to rounding.

Experts. A router scores every expert for a token (V2: softmax; V3: sigmoid, plus a learned
bias for choosing only), keeps the best ``topk_group`` groups of experts and the top k
experts in them, and weighs their outputs (V3: renormalized), times a scaling factor. The
experts run grouped across the batch, one matmul pair per expert over the tokens routed to
it, in expert order (the order transformers sums them in), and shared experts run on every
token.

Shapes: T tokens, H hidden, Nh heads, C latent dims, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.architectures import Architecture, GGUFMetadata
from kvgate.model.attention import AttentionMetadata
from kvgate.model.config import ModelConfig, RopeScaling, yarn_mscale
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.decoder import DecoderModel, head_weights, per_layer
from kvgate.model.hf_loader import positive_int, read_rope
from kvgate.model.kv_spec import KVSpec
from kvgate.model.linear import Linear, Weight
from kvgate.model.quant_tensor import QuantTensor
from kvgate.model.rope import RotaryEmbedding, apply_rotary
from kvgate.model.row_roles import RowRoles, apply


@dataclass(frozen=True)
class DeepseekFields:
    """DeepSeek's own settings (``ModelConfig.arch_fields``)."""

    q_lora_rank: int | None  # None: q straight from h
    kv_lora_rank: int  # C
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    #: The rotary dims are pairs (x0, x1), (x2, x3), ... (V2 always; V3 by default).
    rope_interleave: bool
    first_k_dense_replace: int  # layers before this one have a dense MLP
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    #: "softmax" (V2: greedy or group-limited greedy) or "sigmoid" (V3: with a choice bias).
    #: V2 also rotates in float32 whatever the model dtype (transformers' complex RoPE);
    #: V3 in the model dtype.
    scoring: str
    group_limited: bool
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _fields(config: ModelConfig) -> DeepseekFields:
    fields = config.arch_fields
    assert isinstance(fields, DeepseekFields), "a DeepSeek model without its fields"
    return fields


@dataclass(frozen=True)
class LatentAttention:
    q_a: Linear | None  # H -> q_lora (None: ``q`` reads h)
    q_a_norm: torch.Tensor | None  # [q_lora]
    q: Linear  # q_lora (or H) -> Nh (nope + rope)
    kv_a: Linear  # H -> C + rope
    kv_a_norm: torch.Tensor  # [C]
    w_uk: torch.Tensor  # [Nh, nope, C] float32: a head's no-position key is W_UK[h] c
    w_uv: torch.Tensor  # [Nh, C, v] float32: its value is c W_UV[h]
    o: Linear  # Nh v -> H


@dataclass(frozen=True)
class Experts:
    router: torch.Tensor  # [E, H] float32
    choice_bias: torch.Tensor | None  # [E] float32, V3's (for choosing only)
    experts: tuple[tuple[Linear, Linear], ...]  # per expert: gate_up (H -> 2 I), down
    shared: tuple[Linear, Linear] | None  # the shared experts, as one MLP


@dataclass(frozen=True)
class DeepseekLayer:
    input_norm: torch.Tensor  # [H]
    attn: LatentAttention
    post_norm: torch.Tensor  # [H]
    dense: tuple[Linear, Linear] | None  # gate_up, down (the first layers)
    moe: Experts | None  # (the others)


class DeepseekModel(DecoderModel[DeepseekLayer]):
    @staticmethod
    def kv_specs(config: ModelConfig) -> tuple[KVSpec, ...]:
        """Each layer keeps [c, k_pe] a token: C + rope values, the first C its value."""
        f = _fields(config)
        dim = f.kv_lora_rank + f.qk_rope_head_dim
        return tuple(KVSpec.latent(dim, f.kv_lora_rank) for _ in range(config.num_layers))

    @property
    def fields(self) -> DeepseekFields:
        return _fields(self.config)

    def _setup(self, kernels: CpuKernels | None) -> None:
        c, f = self.config, self.fields
        self.rope = RotaryEmbedding(
            f.qk_rope_head_dim,
            c.max_position_embeddings,
            c.rope_theta,
            c.rope_scaling,
            torch.float32 if self._rotates_in_float32 else self.dtype,
            self.device,
        )

    @property
    def _rotates_in_float32(self) -> bool:
        return self.fields.scoring == "softmax"  # V2 (see ``DeepseekFields.scoring``)

    def _layer(self, weights: Mapping[str, Weight], i: int) -> DeepseekLayer:
        c, f = self.config, self.fields
        p, h = f"model.layers.{i}.", (c.hidden_size,)
        return DeepseekLayer(
            input_norm=self._norm(weights, p + "input_layernorm.weight", h),
            attn=self._latent_attention(weights, p + "self_attn."),
            post_norm=self._norm(weights, p + "post_attention_layernorm.weight", h),
            dense=self._mlp(weights, p + "mlp.", c.intermediate_size)
            if i < f.first_k_dense_replace
            else None,
            moe=self._experts(weights, p + "mlp.") if i >= f.first_k_dense_replace else None,
        )

    def _latent_attention(self, weights: Mapping[str, Weight], p: str) -> LatentAttention:
        c, f = self.config, self.fields
        h, nh = c.hidden_size, c.num_heads
        q_out = nh * f.qk_head_dim
        q_a = q_a_norm = None
        if f.q_lora_rank is None:
            q = self.linear(self._raw(weights, p + "q_proj.weight", (q_out, h)), None)
        else:
            r = f.q_lora_rank
            q_a = self.linear(self._raw(weights, p + "q_a_proj.weight", (r, h)), None)
            q_a_norm = self._norm(weights, p + "q_a_layernorm.weight", (r,))
            q = self.linear(self._raw(weights, p + "q_b_proj.weight", (q_out, r)), None)
        latent = f.kv_lora_rank
        kv_a = self.linear(
            self._raw(weights, p + "kv_a_proj_with_mqa.weight", (latent + f.qk_rope_head_dim, h)),
            None,
        )
        kv_b = self._raw(
            weights, p + "kv_b_proj.weight", (nh * (f.qk_nope_head_dim + f.v_head_dim), latent)
        )
        # Kept in float32 whatever the model dtype: the absorbed products are batched
        # matmuls of one or a few rows a head, which PyTorch runs ~4x faster in float32 than
        # in bf16 on CPU (16 heads x [1, 64] @ [64, 256]: 9 against 38 us, AMX Xeon).
        w = kv_b if isinstance(kv_b, torch.Tensor) else kv_b.dequantize()
        w = w.to(device=self.device, dtype=torch.float32)
        w = w.view(nh, f.qk_nope_head_dim + f.v_head_dim, latent)
        o = self._raw(weights, p + "o_proj.weight", (h, nh * f.v_head_dim))
        return LatentAttention(
            q_a=q_a,
            q_a_norm=q_a_norm,
            q=q,
            kv_a=kv_a,
            kv_a_norm=self._norm(weights, p + "kv_a_layernorm.weight", (latent,)),
            w_uk=w[:, : f.qk_nope_head_dim].contiguous(),
            w_uv=w[:, f.qk_nope_head_dim :].transpose(1, 2).contiguous(),
            o=self.linear(o, None),
        )

    def _mlp(self, weights: Mapping[str, Weight], p: str, inter: int) -> tuple[Linear, Linear]:
        h = self.config.hidden_size
        gate = self._raw(weights, p + "gate_proj.weight", (inter, h))
        up = self._raw(weights, p + "up_proj.weight", (inter, h))
        down = self._raw(weights, p + "down_proj.weight", (h, inter))
        return self.linear.fused([gate, up], None), self.linear(down, None)

    def _experts(self, weights: Mapping[str, Weight], p: str) -> Experts:
        c, f = self.config, self.fields
        n = f.num_experts
        dev, f32 = self.device, torch.float32  # routing is in float32
        router = self._vector(weights, p + "gate.weight", (n, c.hidden_size)).to(dev, f32)
        bias = None
        if f.scoring == "sigmoid":
            bias = self._vector(weights, p + "gate.e_score_correction_bias", (n,)).to(dev, f32)
        inter = f.moe_intermediate_size
        experts = tuple(self._mlp(weights, f"{p}experts.{e}.", inter) for e in range(n))
        shared = None
        if f.num_shared_experts:
            shared = self._mlp(weights, p + "shared_experts.", inter * f.num_shared_experts)
        return Experts(router, bias, experts, shared)

    def _layer_linears(self, layer: DeepseekLayer) -> Iterator[Linear]:
        a = layer.attn
        if a.q_a is not None:
            yield a.q_a
        yield from (a.q, a.kv_a, a.o)
        for mlp in (layer.dense, layer.moe and layer.moe.shared):
            if mlp:
                yield from mlp
        if layer.moe is not None:  # every expert: what a batch of many tokens reads
            for gate_up, down in layer.moe.experts:
                yield from (gate_up, down)

    def _layer_norms(self, layer: DeepseekLayer) -> Iterator[torch.Tensor]:
        yield from (layer.input_norm, layer.post_norm, layer.attn.kv_a_norm)
        if layer.attn.q_a_norm is not None:
            yield layer.attn.q_a_norm

    # ------------------------------------------------------------------ forward
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
        metas = per_layer(meta, len(self.layers))
        cos, sin = self.rope.tables(positions)
        x = self.embed(input_ids)  # [T, H]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i and pause:
                yield
            h = self._rms(x, layer.input_norm)
            x = x + self._attend(layer.attn, h, cos, sin, k_cache, v_cache, metas[i], roles)
            h = self._rms(x, layer.post_norm)
            if layer.moe is None:
                assert layer.dense is not None
                x = x + self._gated(layer.dense, h, roles)
            else:
                x = x + self._moe(layer.moe, h, roles)
        return self._rms(x, self.final_norm)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers' DeepSeek computes it: in float32, cast back, then scaled."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over the rotary dims [T, heads, rope]; interleaved pairs are first laid out
        as halves (evens, then odds), as transformers' V3 returns them. Queries and keys get
        the same order, so their products are those of the pairs."""
        if self.fields.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        if self._rotates_in_float32:
            return apply_rotary(x.float(), cos, sin).to(x.dtype)
        return apply_rotary(x, cos, sin)

    def _attend(
        self,
        a: LatentAttention,
        h: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        roles: RowRoles | None,
    ) -> torch.Tensor:  # [T, H]
        f, t, nh = self.fields, h.shape[0], self.config.num_heads
        if a.q_a is not None:
            assert a.q_a_norm is not None
            q = apply(roles, a.q, self._rms(apply(roles, a.q_a, h), a.q_a_norm))
        else:
            q = apply(roles, a.q, h)
        q_nope, q_pe = torch.split(
            q.view(t, nh, f.qk_head_dim), [f.qk_nope_head_dim, f.qk_rope_head_dim], dim=-1
        )
        kv = apply(roles, a.kv_a, h)
        c, k_pe = torch.split(kv, [f.kv_lora_rank, f.qk_rope_head_dim], dim=-1)
        c = self._rms(c, a.kv_a_norm)
        q_pe = self._rotate(q_pe, cos, sin)  # [T, Nh, rope]
        k_pe = self._rotate(k_pe.view(t, 1, f.qk_rope_head_dim), cos, sin)  # [T, 1, rope]
        q_lat = torch.bmm(q_nope.transpose(0, 1).float(), a.w_uk).transpose(0, 1)  # [T, Nh, C]
        q_lat = q_lat.to(q_pe.dtype)
        query = torch.cat((q_lat, q_pe), dim=-1)  # [T, Nh, C + rope]
        key = torch.cat((c.view(t, 1, f.kv_lora_rank), k_pe), dim=-1)  # [T, 1, C + rope]
        value = key[..., : f.kv_lora_rank]
        self.attention.write_kv(key, value, k_cache, v_cache, meta)
        out = self.attention.attend(query, key, value, k_cache, v_cache, meta)  # [T, Nh, C]
        heads = torch.bmm(out.transpose(0, 1).float(), a.w_uv).transpose(0, 1)  # [T, Nh, v]
        heads = heads.to(out.dtype)
        return apply(roles, a.o, heads.reshape(t, nh * f.v_head_dim))

    @staticmethod
    def _gated(mlp: tuple[Linear, Linear], h: torch.Tensor, roles: RowRoles | None) -> torch.Tensor:
        gate_up, down = mlp
        gate, up = apply(roles, gate_up, h).chunk(2, dim=-1)
        return apply(roles, down, F.silu(gate) * up)

    def _route(self, e: Experts, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (float32)."""
        f, t = self.fields, h.shape[0]
        logits = F.linear(h.float(), e.router)  # [T, E]
        groups = (t, f.n_group, f.num_experts // f.n_group)
        if f.scoring == "sigmoid":  # V3: groups by their two best, a bias for choosing only
            scores = logits.sigmoid()
            assert e.choice_bias is not None
            choice = scores + e.choice_bias
            group_scores = choice.view(groups).topk(2, dim=-1)[0].sum(dim=-1)
            fill = float("-inf")
        else:  # V2: softmax, groups by their best
            scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
            group_scores = choice.view(groups).max(dim=-1).values
            fill = 0.0
        if f.group_limited:
            best = torch.topk(group_scores, k=f.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, best, 1)
            keep = mask.unsqueeze(-1).expand(groups).reshape(t, f.num_experts).bool()
            choice = choice.masked_fill(~keep, fill)
        index = torch.topk(choice, k=f.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if f.scoring == "sigmoid" and f.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weights * f.routed_scaling_factor

    def _moe(self, e: Experts, h: torch.Tensor, roles: RowRoles | None) -> torch.Tensor:
        """The routed experts, then the shared ones."""
        out = self._routed(e, h)
        if e.shared is not None:
            out = out + self._gated(e.shared, h, roles)
        return out

    def _routed(self, e: Experts, h: torch.Tensor) -> torch.Tensor:
        """The routed experts, grouped by expert across the batch.

        The step's (token, expert) pairs are sorted by expert once: each expert then reads
        one contiguous slice of the gathered rows and writes one slice of the outputs. Per
        expert that is its two matmuls and the activation, nothing else: with 16 sequences
        nearly every expert has a token or two, and per-expert gathers and adds cost more
        than its matmuls (bench/moe.py). Within an expert the rows come in transformers'
        eager order (by place among the token's k, then by token): a matmul's rows need not
        come out alike at other positions in it (they do not on AVX2). Each token's k
        outputs are then added in ascending expert order from zero, the order transformers
        adds them in, so fp32 sums are bit-identical."""
        index, weights = self._route(e, h)  # [T, k] each
        return grouped_experts(
            h, index, weights, len(e.experts), lambda i, x: self._gated(e.experts[i], x, None)
        )


def grouped_experts(
    h: torch.Tensor,  # [T, H]
    index: torch.Tensor,  # [T, k] int64: each token's experts
    weights: torch.Tensor,  # [T, k]: their weights
    num_experts: int,
    mlp: Callable[[int, torch.Tensor], torch.Tensor],  # expert, rows [n, H] -> [n, H]
) -> torch.Tensor:  # [T, H]
    """The routed experts' weighted sum, grouped by expert across the batch (see
    ``DeepseekModel._routed``; DeepSeek-V4 runs its experts through it too)."""
    t, k = index.shape
    experts = index.t().flatten()  # place-major: pair p is token p % T, place p // T
    order = torch.argsort(experts, stable=True)
    tokens, places = order % t, order // t
    order = tokens * k + places  # each pair's position in token-major [T, k]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    x = h.index_select(0, tokens)  # [T k, H]
    y = torch.empty_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            y[start : start + n] = mlp(expert, x[start : start + n])
            start += n
    scaled = (y * weights.flatten()[order, None]).to(h.dtype)
    pairs = torch.empty_like(scaled).index_copy_(0, order, scaled).view(t, k, -1)
    rows = torch.arange(t, device=h.device)
    out = torch.zeros_like(h)
    for place in torch.argsort(index, dim=1).unbind(1):  # each token's experts, ascending
        out = out + pairs[rows, place]
    return out


# ---------------------------------------------------------------------- config and weights


def deepseek_weights(
    arch: Architecture, config: ModelConfig
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight ``DeepseekModel._layer`` reads, HF names."""
    f = _fields(config)
    h, nh, latent = config.hidden_size, config.num_heads, f.kv_lora_rank
    yield "model.embed_tokens.weight", (config.vocab_size, h)

    def mlp(p: str, inter: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield p + "gate_proj.weight", (inter, h)
        yield p + "up_proj.weight", (inter, h)
        yield p + "down_proj.weight", (h, inter)

    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if f.q_lora_rank is None:
            yield a + "q_proj.weight", (nh * f.qk_head_dim, h)
        else:
            yield a + "q_a_proj.weight", (f.q_lora_rank, h)
            yield a + "q_a_layernorm.weight", (f.q_lora_rank,)
            yield a + "q_b_proj.weight", (nh * f.qk_head_dim, f.q_lora_rank)
        yield a + "kv_a_proj_with_mqa.weight", (latent + f.qk_rope_head_dim, h)
        yield a + "kv_a_layernorm.weight", (latent,)
        yield a + "kv_b_proj.weight", (nh * (f.qk_nope_head_dim + f.v_head_dim), latent)
        yield a + "o_proj.weight", (h, nh * f.v_head_dim)
        if i < f.first_k_dense_replace:
            yield from mlp(p + "mlp.", config.intermediate_size)
        else:
            yield p + "mlp.gate.weight", (f.num_experts, h)
            if f.scoring == "sigmoid":
                yield p + "mlp.gate.e_score_correction_bias", (f.num_experts,)
            for e in range(f.num_experts):
                yield from mlp(f"{p}mlp.experts.{e}.", f.moe_intermediate_size)
            if f.num_shared_experts:
                shared = f.moe_intermediate_size * f.num_shared_experts
                yield from mlp(p + "mlp.shared_experts.", shared)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield from head_weights(config)


def _hf_fields(raw: Mapping[str, Any], file: str, v3: bool) -> dict[str, Any]:
    """DeepSeek's config.json keys (transformers' spellings, and the original checkpoints')."""
    if raw.get("attention_bias"):
        raise UnsupportedModel(f"{file}: attention_bias is not supported", path=file)
    if raw.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModel(f"{file}: moe_layer_freq other than 1 is not supported", path=file)
    # transformers' defaults where a key is missing (its configs list every one of them).
    defaults: dict[str, Any] = (
        {"q_lora_rank": 1536, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
         "n_shared_experts": 1}
        if v3
        else {"q_lora_rank": 1536, "n_group": None, "topk_group": None,
              "first_k_dense_replace": 0, "n_shared_experts": 2}
    )  # fmt: skip
    raw = {**defaults, **raw}
    q_lora = raw["q_lora_rank"]
    experts = positive_int(raw, "n_routed_experts", file)
    per_token = positive_int(raw, "num_experts_per_tok", file)
    n_group = raw["n_group"] or 1
    topk_group = raw["topk_group"] or n_group
    method = raw.get("topk_method", "noaux_tc" if v3 else "greedy")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModel(f"{file}: topk_method {method!r} is not supported", path=file)
    limited = v3 or method == "group_limited_greedy"
    if (
        not all(isinstance(v, int) and not isinstance(v, bool) for v in (n_group, topk_group))
        or experts % n_group
        or not 0 < topk_group <= n_group
        or (v3 and experts // n_group < 2)  # a group scores by its two best experts
        or per_token > (topk_group * experts // n_group if limited else experts)
    ):
        raise CorruptWeights(
            f"{file}: n_group {n_group!r}, topk_group {topk_group!r} and num_experts_per_tok "
            f"{per_token} do not fit {experts} experts (n_group must divide them, hold "
            "topk_group groups, and those groups at least num_experts_per_tok experts)",
            path=file,
        )
    fields = DeepseekFields(
        q_lora_rank=None if q_lora is None else positive_int(raw, "q_lora_rank", file),
        kv_lora_rank=positive_int(raw, "kv_lora_rank", file),
        qk_nope_head_dim=positive_int(raw, "qk_nope_head_dim", file),
        qk_rope_head_dim=positive_int(raw, "qk_rope_head_dim", file),
        v_head_dim=positive_int(raw, "v_head_dim", file),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
        first_k_dense_replace=int(raw["first_k_dense_replace"] or 0),
        num_experts=experts,
        experts_per_token=per_token,
        num_shared_experts=int(raw["n_shared_experts"] or 0),
        moe_intermediate_size=positive_int(raw, "moe_intermediate_size", file),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        scoring="sigmoid" if v3 else "softmax",
        group_limited=limited,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
    )
    _, scaling = read_rope(raw, file)
    heads = positive_int(raw, "num_attention_heads", file)
    return {
        "arch_fields": fields,
        "head_dim": fields.qk_head_dim,
        "num_kv_heads": heads,
        "attention_scale": _softmax_scale(fields, scaling),
    }


def _softmax_scale(fields: DeepseekFields, scaling: RopeScaling | None) -> float:
    """Of the whole q.k head, times YaRN's mscale over all dims, squared."""
    scale: float = fields.qk_head_dim**-0.5
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def deepseek_v2_hf_fields(raw: Mapping[str, Any], file: str) -> dict[str, Any]:
    return _hf_fields(raw, file, v3=False)


def deepseek_v3_hf_fields(raw: Mapping[str, Any], file: str) -> dict[str, Any]:
    return _hf_fields(raw, file, v3=True)


def deepseek_export_hf(c: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers' DeepSeek reads it."""
    f = _fields(c)
    out = dict(hf)
    out.update(
        head_dim=f.qk_rope_head_dim,
        q_lora_rank=f.q_lora_rank,
        kv_lora_rank=f.kv_lora_rank,
        qk_nope_head_dim=f.qk_nope_head_dim,
        qk_rope_head_dim=f.qk_rope_head_dim,
        v_head_dim=f.v_head_dim,
        first_k_dense_replace=f.first_k_dense_replace,
        n_routed_experts=f.num_experts,
        num_experts_per_tok=f.experts_per_token,
        n_shared_experts=f.num_shared_experts,
        moe_intermediate_size=f.moe_intermediate_size,
        routed_scaling_factor=f.routed_scaling_factor,
        n_group=f.n_group,
        topk_group=f.topk_group,
        norm_topk_prob=f.norm_topk_prob,
    )
    if f.scoring == "sigmoid":
        out["rope_interleave"] = f.rope_interleave
    else:
        out["topk_method"] = "group_limited_greedy" if f.group_limited else "greedy"
    return out


#: llama.cpp's per-layer names of DeepSeek's tensors. The stacked experts and the split
#: ``kv_b`` land under names of their own that ``deepseek_gguf_tensors`` takes apart.
_GGUF_LAYER_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b.stacked",
    "attn_v_b.weight": "self_attn.v_b.stacked",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.stacked",
    "ffn_up_exps.weight": "mlp.experts.up_proj.stacked",
    "ffn_down_exps.weight": "mlp.experts.down_proj.stacked",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def deepseek_gguf_fields(f: GGUFMetadata, arch: str, num_layers: int) -> dict[str, Any]:
    """llama.cpp's ``deepseek2`` keys (its converter writes V2 and V3 alike). Its head
    counts describe the latent cache as one KV head; the per-head sizes are the ``_mla``
    lengths (older files: the plain ones). The gating function tells V3's sigmoid routing
    with a choice bias from V2's softmax."""
    heads = f.pos_int(f"{arch}.attention.head_count")
    latent = f.pos_int(f"{arch}.attention.kv_lora_rank")
    rope = f.pos_int(f"{arch}.rope.dimension_count")
    key = f.opt_int(f"{arch}.attention.key_length_mla") or f.pos_int(f"{arch}.attention.key_length")
    value = f.opt_int(f"{arch}.attention.value_length_mla") or f.pos_int(
        f"{arch}.attention.value_length"
    )
    if key <= rope:
        raise CorruptWeights(
            f"{arch}: key length {key} leaves no room for {rope} rotary dims", path=arch
        )
    sigmoid = f.opt_int(f"{arch}.expert_gating_func") == 2  # llama.cpp: 1 softmax, 2 sigmoid
    experts = f.pos_int(f"{arch}.expert_count")
    n_group = f.opt_int(f"{arch}.expert_group_count") or 1
    fields = DeepseekFields(
        q_lora_rank=f.opt_int(f"{arch}.attention.q_lora_rank"),
        kv_lora_rank=latent,
        qk_nope_head_dim=key - rope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
        rope_interleave=True,  # llama.cpp rotates DeepSeek's pairs as they are
        first_k_dense_replace=f.opt_int(f"{arch}.leading_dense_block_count") or 0,
        num_experts=experts,
        experts_per_token=f.pos_int(f"{arch}.expert_used_count"),
        num_shared_experts=f.opt_int(f"{arch}.expert_shared_count") or 0,
        moe_intermediate_size=f.pos_int(f"{arch}.expert_feed_forward_length"),
        routed_scaling_factor=f.opt_pos_float(f"{arch}.expert_weights_scale") or 1.0,
        scoring="sigmoid" if sigmoid else "softmax",
        group_limited=sigmoid or n_group > 1,
        n_group=n_group,
        topk_group=f.opt_int(f"{arch}.expert_group_used_count") or n_group,
        norm_topk_prob=bool(f.opt_bool(f"{arch}.expert_weights_norm")),
    )
    scaling = None
    kind = f.opt_str(f"{arch}.rope.scaling.type")
    if kind == "yarn":
        # The converter writes 0.1 x mscale_all_dim; DeepSeek's mscale equals it.
        log_mul = f.opt_pos_float(f"{arch}.rope.scaling.yarn_log_multiplier")
        mscale = None if log_mul is None else log_mul / 0.1
        scaling = RopeScaling(
            "yarn",
            f.pos_f32(f"{arch}.rope.scaling.factor"),
            original_max_position_embeddings=f.pos_int(
                f"{arch}.rope.scaling.original_context_length"
            ),
            mscale=mscale,
            mscale_all_dim=mscale,
        )
    elif kind not in (None, "none"):
        raise UnsupportedModel(f"{arch}: rope scaling {kind!r} is not supported", path=arch)
    return {
        "arch_fields": fields,
        "head_dim": fields.qk_head_dim,
        "num_kv_heads": heads,
        "attention_scale": _softmax_scale(fields, scaling),
        "rope_scaling": scaling,
    }


def deepseek_gguf_tensors(weights: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """Experts stacked one tensor a layer, ``[E, I, H]`` (or, kept in blocks, their
    ``E I`` rows), become one matrix per expert: slices, never copies of the blocks. A
    ``kv_b`` split as llama.cpp's absorbed attention wants it (``k_b`` per head transposed,
    ``v_b``) becomes transformers' ``kv_b_proj`` again."""
    f = _fields(config)
    out: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, w in weights.items():
        if not name.endswith(".stacked"):
            out[name] = w
            continue
        prefix, _, kind = name.removesuffix(".stacked").rpartition(".")
        if kind in ("k_b", "v_b"):
            parts.setdefault(prefix, {})[kind] = w
            continue
        stacked = not isinstance(w, QuantTensor)  # [E, I, H]; blocks: [E I, H]
        if (w.shape[0] != f.num_experts) if stacked else (w.shape[0] % f.num_experts):
            raise CorruptWeights(
                f"{name}: a stack of shape {list(w.shape)} for {f.num_experts} experts",
                path=name,
            )
        rows = w.shape[1] if stacked else w.shape[0] // f.num_experts
        for e in range(f.num_experts):
            piece = w[e] if stacked else _rows(w, e * rows, (e + 1) * rows)
            out[f"{prefix}.{e}.{kind}.weight"] = piece
    nh, latent = config.num_heads, f.kv_lora_rank
    for prefix, pair in parts.items():
        if set(pair) != {"k_b", "v_b"}:
            raise CorruptWeights(f"{prefix}: a GGUF with k_b or v_b alone", path=prefix)
        k_b = _dense(pair["k_b"]).reshape(nh, latent, f.qk_nope_head_dim)
        v_b = _dense(pair["v_b"]).reshape(nh, f.v_head_dim, latent)
        kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
        out[f"{prefix}.kv_b_proj.weight"] = kv_b.reshape(-1, latent).contiguous()
    return out


def _rows(w: QuantTensor, start: int, end: int) -> QuantTensor:
    """Rows ``start:end`` of a block-format tensor: a view of the same bytes."""
    return QuantTensor(w.qtype, (end - start, w.shape[1]), w.data[start:end], w.name)


def _dense(w: Any) -> torch.Tensor:
    return w.dequantize() if isinstance(w, QuantTensor) else w.float()


def deepseek_unused_weight(config: ModelConfig, name: str) -> bool:
    """The multi-token-prediction layers DeepSeek-V3 checkpoints carry after the last layer
    (``num_nextn_predict_layers``): a speculative head this forward pass does not run."""
    if not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    return index.isdigit() and int(index) >= config.num_layers


DEEPSEEK_V2 = Architecture(
    "deepseek_v2",
    ("deepseek_v2",),
    None,  # llama.cpp's "deepseek2" files are read as DEEPSEEK_V3's, whose fields cover V2
    "DeepseekV2ForCausalLM",
    DeepseekModel,
    deepseek_weights,
    hf_fields=deepseek_v2_hf_fields,
    export_hf=deepseek_export_hf,
)
DEEPSEEK_V3 = Architecture(
    "deepseek_v3",
    ("deepseek_v3",),
    "deepseek2",  # llama.cpp's name for V2 and V3 alike: its metadata tells them apart
    "DeepseekV3ForCausalLM",
    DeepseekModel,
    deepseek_weights,
    gguf_layer_names=_GGUF_LAYER_NAMES,
    gguf_fields=deepseek_gguf_fields,
    gguf_tensors=deepseek_gguf_tensors,
    hf_fields=deepseek_v3_hf_fields,
    export_hf=deepseek_export_hf,
    unused_weight=deepseek_unused_weight,
)
ARCHITECTURES = (DEEPSEEK_V2, DEEPSEEK_V3)
