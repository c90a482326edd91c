"""DeepSeek-V4: attention over a sliding window plus compressed KV, hyper-connections, and
experts routed by hash or by top k. Its record is at the end, with the config reader and the
weight list (DeepSeek's own tensor names).

Attention (per layer). One KV head, its key also its value (K = V), ``D`` dims of which the
last ``rope`` rotate (pairs, interleaved); q through a low-rank bottleneck, RMS-normed per
head. Every layer attends over the last ``sliding_window`` positions. A compressed layer also
turns each window of ``rate`` tokens into one entry (a softmax-gated sum of their projections
``kv`` and ``gate`` plus a learned bias per place in the window, RMS-normed, rotated at the
window's first position): heavily compressed layers (HCA, rate 128) over one window, sparse
ones (CSA, rate 4) over two overlapping ones, the previous window's half ``Ca`` and the
current one's ``Cb``. A query at position ``t`` sees the entries of the windows that ended at
or before it: every one (HCA), or the ``index_topk`` an indexer scores highest (CSA: a
second, smaller compressor whose entries are keys for ``index_heads`` ReLU-scored query
heads). A per-head learned sink logit joins the softmax. The output's rotary dims are rotated
back to the query's position, then heads go through a grouped projection (``o_groups``
groups of heads to ``o_lora`` dims each) and ``o_b``.

The pool (``KVSpec.compressed``, ``compressed_kv.py``) keeps per token the window's vector
and what the compressor still needs of it (its ``kv`` and ``gate`` projections), over the
last ``max(sliding_window, 2 rate)`` positions; and per layer one entry per ``rate`` tokens
([compressed key, indexer key] for CSA), for the whole sequence. Every entry is computed once,
when its window's last token is, from what the pool holds: a prompt prefilled in chunks or
continued from a prefix-cache hit computes the same entries as one prefilled whole.

Residual: ``hc_mult`` streams a token ([T, n, H]); before each block a learned mix collapses
them into its input and after it spreads its output back and mixes the streams (a
Sinkhorn-normalized [n, n] matrix); a last mix collapses them before the final norm.

Experts: scores ``sqrt(softplus(logits))`` (or sigmoid); the first layers route each token by
a fixed table of its id (``tid2eid``), the others by top k of the scores plus a bias; the
chosen scores, renormalized and scaled, weigh the experts (gate and up clamped to
``swiglu_limit``), run grouped by expert across the batch, and one shared expert.

Shapes: T tokens, H hidden, n streams, Nh heads, D head dim, E experts.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.architectures import Architecture
from kvgate.model.attention import AttentionMetadata
from kvgate.model.compressed_kv import (
    CompressedMetadata,
    SequenceRows,
    read_entries,
    read_tokens,
    write_entries,
    write_tokens,
)
from kvgate.model.config import ModelConfig, RopeScaling
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.decoder import DecoderModel
from kvgate.model.deepseek import grouped_experts
from kvgate.model.hf_loader import positive_int, read_rope
from kvgate.model.kv_spec import KVSpec
from kvgate.model.linear import Linear, Weight
from kvgate.model.rope import inverse_frequencies
from kvgate.model.row_roles import RowRoles, apply

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
#: Queries a sparse attention gathers keys for at once (bf16, k = 512, D = 512: 32 MiB).
_SPARSE_ROWS = 64
SLIDING = "sliding_attention"
_RATE_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # legacy ``compress_ratios``


@dataclass(frozen=True)
class V4Fields:
    """DeepSeek-V4's own settings (``ModelConfig.arch_fields``)."""

    q_lora_rank: int
    rope_dim: int  # the rotary dims at the end of each head
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    csa_rate: int
    hca_rate: int
    compress_theta: float
    compress_scaling: RopeScaling | None
    hc_mult: int
    hc_iters: int
    hc_eps: float
    hashed: tuple[bool, ...]  # per layer: experts by the token's id
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    swiglu_limit: float
    scoring: str  # "sqrtsoftplus" or "sigmoid"
    routed_scaling_factor: float
    index_heads: int
    index_head_dim: int
    index_topk: int

    def rate(self, layer: int) -> int:
        """Tokens an entry of ``layer`` stands for (0: the window alone)."""
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 0


def _fields(config: ModelConfig) -> V4Fields:
    fields = config.arch_fields
    assert isinstance(fields, V4Fields), "a DeepSeek-V4 model without its fields"
    return fields


@dataclass(frozen=True)
class Compressor:
    kv: Linear  # H -> c D (c = 2 for CSA: Ca and Cb; 1 for HCA)
    gate: Linear  # H -> c D
    bias: torch.Tensor  # [rate, c D] float32: per place in the window
    norm: torch.Tensor  # [D] float32


@dataclass(frozen=True)
class Indexer:
    compressor: Compressor  # of index_head_dim
    q: Linear  # q_lora -> index_heads x index_head_dim
    weights: Linear  # H -> index_heads


@dataclass(frozen=True)
class V4Attention:
    q_a: Linear  # H -> q_lora
    q_norm: torch.Tensor  # [q_lora] float32
    q_b: Linear  # q_lora -> Nh D
    kv: Linear  # H -> D
    kv_norm: torch.Tensor  # [D] float32
    o_a: torch.Tensor  # [groups, Nh D / groups, o_lora]: the grouped projection, as bmm reads it
    o_b: Linear  # groups o_lora -> H
    sinks: torch.Tensor  # [Nh] float32
    compressor: Compressor | None
    indexer: Indexer | None


@dataclass(frozen=True)
class HyperMix:
    fn: torch.Tensor  # [(2 + n) n, n H] float32 (the final one: [n, n H])
    base: torch.Tensor  # [(2 + n) n] float32
    scale: torch.Tensor  # [3] float32


@dataclass(frozen=True)
class V4Experts:
    router: torch.Tensor  # [E, H], the model's dtype (transformers scores in it)
    bias: torch.Tensor | None  # [E] float32: for choosing only (top-k layers)
    table: torch.Tensor | None  # [V, k] int64: each token id's experts (hash layers)
    experts: tuple[tuple[Linear, Linear], ...]  # gate_up (H -> 2 I), down
    shared: tuple[Linear, Linear]


@dataclass(frozen=True)
class V4Layer:
    attn_norm: torch.Tensor  # [H] float32
    attn: V4Attention
    ffn_norm: torch.Tensor  # [H] float32
    moe: V4Experts
    attn_mix: HyperMix
    ffn_mix: HyperMix


def _compressors(a: V4Attention) -> list[Compressor]:
    """The layer's compressors, in the order the pool keeps their projections."""
    out = [] if a.compressor is None else [a.compressor]
    return out + ([] if a.indexer is None else [a.indexer.compressor])


def _rope_tables(
    dim: int, theta: float, scaling: RopeScaling | None, positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, dim // 2] of each pair's angle, as transformers' V4 computes them
    (float32, times YaRN's factor, cast)."""
    inv_freq = inverse_frequencies(dim, theta, scaling)
    freqs = torch.outer(torch.arange(positions, dtype=torch.int64).float(), inv_freq)
    scale = scaling.cos_sin_scale() if scaling is not None else 1.0
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last ``2 cos.shape[-1]`` dims of x [..., dim], as interleaved pairs (x0,
    x1), (x2, x3), ...; cos, sin [..., dim_rope // 2] broadcast over x's middle dims. In
    float32, cast back."""
    rope = 2 * cos.shape[-1]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    nope, r = x[..., :-rope], x[..., -rope:]
    turned = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    rotated = (r.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)


class DeepseekV4Model(DecoderModel[V4Layer]):
    @staticmethod
    def kv_specs(config: ModelConfig) -> tuple[KVSpec, ...]:
        """Per token: the window's vector (D) and the compressor's projections (CSA: kv and
        gate of Ca and Cb, 4 D, and the indexer's, 4 index dims; HCA: 2 D), over the window
        and the two (CSA) or one (HCA) compression windows before; per entry: its key (D) and
        the indexer's key (CSA)."""
        f, d = _fields(config), config.head_dim
        specs = []
        for i, kind in enumerate(f.layer_types):
            rate = f.rate(i)
            if kind == CSA:
                token, entry = 5 * d + 4 * f.index_head_dim, d + f.index_head_dim
                window = 2 * rate
            elif kind == HCA:
                token, entry, window = 3 * d, d, rate
            else:
                token, entry, window = d, 0, 0
            specs.append(
                KVSpec.compressed(max(f.sliding_window, window), token, rate or None, entry)
            )
        return tuple(specs)

    @property
    def fields(self) -> V4Fields:
        return _fields(self.config)

    def _setup(self, kernels: CpuKernels | None) -> None:
        c, f = self.config, self.fields
        n = c.max_position_embeddings
        self.main_rope = _rope_tables(f.rope_dim, c.rope_theta, None, n, self.dtype)
        self.compress_rope = _rope_tables(
            f.rope_dim, f.compress_theta, f.compress_scaling, n, self.dtype
        )
        self.final_mix = HyperMix(
            self._f32(self._weight_in, "hc_head_fn", (f.hc_mult, f.hc_mult * c.hidden_size)),
            self._f32(self._weight_in, "hc_head_base", (f.hc_mult,)),
            self._f32(self._weight_in, "hc_head_scale", (1,)),
        )
        del self._weight_in

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight], **kwargs: Any) -> None:
        self._weight_in = weights  # read by ``_setup`` (the final mix), then dropped
        super().__init__(config, weights, **kwargs)

    # ------------------------------------------------------------------ reading weights
    def _f32(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A weight transformers keeps in float32 whatever the model's dtype."""
        return self._vector(weights, name, shape).to(self.device, torch.float32).contiguous()

    def _layer(self, weights: Mapping[str, Weight], i: int) -> V4Layer:
        c, f = self.config, self.fields
        p, h, n = f"model.layers.{i}.", c.hidden_size, f.hc_mult
        mix = (2 + n) * n

        def hyper(kind: str) -> HyperMix:
            return HyperMix(
                self._f32(weights, f"{p}hc_{kind}_fn", (mix, n * h)),
                self._f32(weights, f"{p}hc_{kind}_base", (mix,)),
                self._f32(weights, f"{p}hc_{kind}_scale", (3,)),
            )

        return V4Layer(
            attn_norm=self._f32(weights, p + "attn_norm.weight", (h,)),
            attn=self._attention(weights, p + "attn.", f.layer_types[i]),
            ffn_norm=self._f32(weights, p + "ffn_norm.weight", (h,)),
            moe=self._experts(weights, p + "ffn.", f.hashed[i]),
            attn_mix=hyper("attn"),
            ffn_mix=hyper("ffn"),
        )

    def _norm(
        self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The final norm, kept in float32 as transformers keeps V4's norms."""
        return self._f32(weights, name, shape)

    def _lin(self, weights: Mapping[str, Weight], name: str, shape: tuple[int, ...]) -> Linear:
        return self.linear(self._raw(weights, name, shape), None)

    def _compressor(
        self, weights: Mapping[str, Weight], p: str, dim: int, copies: int, rate: int
    ) -> Compressor:
        h = self.config.hidden_size
        return Compressor(
            kv=self._lin(weights, p + "wkv.weight", (copies * dim, h)),
            gate=self._lin(weights, p + "wgate.weight", (copies * dim, h)),
            bias=self._f32(weights, p + "ape", (rate, copies * dim)),
            norm=self._f32(weights, p + "norm.weight", (dim,)),
        )

    def _attention(self, weights: Mapping[str, Weight], p: str, kind: str) -> V4Attention:
        c, f = self.config, self.fields
        h, nh, d = c.hidden_size, c.num_heads, c.head_dim
        g, r = f.o_groups, f.o_lora_rank
        o_a = self._raw(weights, p + "wo_a.weight", (g * r, nh * d // g))
        o_a = o_a if isinstance(o_a, torch.Tensor) else o_a.dequantize()
        compressor = indexer = None
        if kind == CSA:
            compressor = self._compressor(weights, p + "compressor.", d, 2, f.csa_rate)
            ih, idim = f.index_heads, f.index_head_dim
            indexer = Indexer(
                compressor=self._compressor(
                    weights, p + "indexer.compressor.", idim, 2, f.csa_rate
                ),
                q=self._lin(weights, p + "indexer.wq_b.weight", (ih * idim, f.q_lora_rank)),
                weights=self._lin(weights, p + "indexer.weights_proj.weight", (ih, h)),
            )
        elif kind == HCA:
            compressor = self._compressor(weights, p + "compressor.", d, 1, f.hca_rate)
        return V4Attention(
            q_a=self._lin(weights, p + "wq_a.weight", (f.q_lora_rank, h)),
            q_norm=self._f32(weights, p + "q_norm.weight", (f.q_lora_rank,)),
            q_b=self._lin(weights, p + "wq_b.weight", (nh * d, f.q_lora_rank)),
            kv=self._lin(weights, p + "wkv.weight", (d, h)),
            kv_norm=self._f32(weights, p + "norm.weight", (d,)),
            o_a=self._cast(o_a.view(g, r, nh * d // g).transpose(1, 2)),
            o_b=self._lin(weights, p + "wo_b.weight", (h, g * r)),
            sinks=self._f32(weights, p + "attn_sink", (nh,)),
            compressor=compressor,
            indexer=indexer,
        )

    def _mlp(self, weights: Mapping[str, Weight], p: str) -> tuple[Linear, Linear]:
        h, inter = self.config.hidden_size, self.fields.moe_intermediate_size
        gate = self._raw(weights, p + "w1.weight", (inter, h))
        up = self._raw(weights, p + "w3.weight", (inter, h))
        down = self._raw(weights, p + "w2.weight", (h, inter))
        return self.linear.fused([gate, up], None), self.linear(down, None)

    def _experts(self, weights: Mapping[str, Weight], p: str, hashed: bool) -> V4Experts:
        c, f = self.config, self.fields
        e = f.num_experts
        router = self._cast(self._vector(weights, p + "gate.weight", (e, c.hidden_size)))
        bias = table = None
        if hashed:
            raw = self._raw(weights, p + "gate.tid2eid", (c.vocab_size, f.experts_per_token))
            assert isinstance(raw, torch.Tensor)
            self._num_params -= raw.numel()  # a routing table, not parameters
            table = raw.to(self.device, torch.int64)
            if bool(((table < 0) | (table >= e)).any()):
                raise CorruptWeights(f"{p}gate.tid2eid names an expert beyond {e}", path=p)
        else:
            bias = self._f32(weights, p + "gate.bias", (e,))
        experts = tuple(self._mlp(weights, f"{p}experts.{x}.") for x in range(e))
        return V4Experts(router, bias, table, experts, self._mlp(weights, p + "shared_experts."))

    def _layer_linears(self, layer: V4Layer) -> Iterator[Linear]:
        a = layer.attn
        yield from (a.q_a, a.q_b, a.kv, a.o_b)
        for comp in _compressors(a):
            yield from (comp.kv, comp.gate)
        if a.indexer is not None:
            yield from (a.indexer.q, a.indexer.weights)
        yield from layer.moe.shared
        for gate_up, down in layer.moe.experts:
            yield from (gate_up, down)

    def _layer_norms(self, layer: V4Layer) -> Iterator[torch.Tensor]:
        a = layer.attn
        yield from (layer.attn_norm, layer.ffn_norm, a.q_norm, a.kv_norm, a.sinks, a.o_a)
        yield from (layer.attn_mix.fn, layer.ffn_mix.fn)

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
        step = meta[0] if isinstance(meta, Sequence) else meta
        assert isinstance(step, CompressedMetadata), "DeepSeek-V4 reads compressed pages"
        n = self.fields.hc_mult
        x = self.embed(input_ids)  # [T, H]
        x = x.unsqueeze(1).expand(-1, n, -1).contiguous()  # [T, n, H]
        main = (self.main_rope[0][positions], self.main_rope[1][positions])
        comp = (self.compress_rope[0][positions], self.compress_rope[1][positions])
        for i, (layer, caches) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i and pause:
                yield
            rope = main if layer.attn.compressor is None else comp
            post, comb, collapsed = self._mix(layer.attn_mix, x)
            h = self._rms(collapsed, layer.attn_norm)
            out = self._attend(i, layer.attn, h, positions, rope, caches, step, roles)
            x = self._spread(post, comb, out, x)
            post, comb, collapsed = self._mix(layer.ffn_mix, x)
            h = self._rms(collapsed, layer.ffn_norm)
            x = self._spread(post, comb, self._moe(layer.moe, h, input_ids, roles), x)
        return self._rms(self._collapse(x), self.final_norm)

    # ------------------------------------------------------------------ the residual streams
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers' V4 computes it: float32, times the (float32) weight, cast."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (weight * xf).to(x.dtype)

    def _unit_rms(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without a weight (q's heads, the streams' mix inputs)."""
        eps = self.config.rms_norm_eps
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)

    def _mix(self, m: HyperMix, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, n], comb [T, n, n], the block's input [T, H]) from the streams [T, n, H]."""
        f = self.fields
        n, eps = f.hc_mult, f.hc_eps
        mixed = F.linear(self._unit_rms(x.flatten(1).float()), m.fn)  # [T, (2 + n) n]
        pre, post, comb = torch.split(mixed, [n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = torch.split(m.base, [n, n, n * n])
        pre = torch.sigmoid(pre * m.scale[0] + b_pre) + eps
        post = 2 * torch.sigmoid(post * m.scale[1] + b_post)
        comb = comb.view(-1, n, n) * m.scale[2] + b_comb.view(n, n)
        comb = torch.softmax(comb, dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(f.hc_iters - 1):  # Sinkhorn: rows and columns summing to one
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)

    @staticmethod
    def _spread(
        post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """The block's output [T, H] spread over the streams, plus the streams mixed."""
        dtype = x.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), x)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed

    def _collapse(self, x: torch.Tensor) -> torch.Tensor:
        m, eps = self.final_mix, self.fields.hc_eps
        mixes = F.linear(self._unit_rms(x.flatten(1).float()), m.fn)
        pre = torch.sigmoid(mixes * m.scale + m.base) + eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)

    # ------------------------------------------------------------------ attention
    def _attend(
        self,
        i: int,
        a: V4Attention,
        h: torch.Tensor,  # [T, H]
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, rope / 2]
        caches: tuple[torch.Tensor, torch.Tensor],
        step: CompressedMetadata,
        roles: RowRoles | None,
    ) -> torch.Tensor:  # [T, H]
        c, t, d = self.config, h.shape[0], self.config.head_dim
        nh = c.num_heads
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)  # [T, 1, rope / 2]
        q_res = self._rms(apply(roles, a.q_a, h), a.q_norm)  # [T, q_lora]
        q = self._unit_rms(apply(roles, a.q_b, q_res).view(t, nh, d))
        q = rotate_pairs(q, cos, sin)
        kv = self._rms(apply(roles, a.kv, h), a.kv_norm)
        kv = rotate_pairs(kv.view(t, 1, d), cos, sin).view(t, d)
        parts = [kv]
        for comp in _compressors(a):
            parts += [apply(roles, comp.kv, h), apply(roles, comp.gate, h)]
        tokens = torch.cat(parts, dim=-1)  # [T, token dims]: what the pool keeps a token
        out = torch.empty_like(q)
        for seq in step.sequences:
            out[seq.row_start : seq.row_end] = self._attend_one(
                i, a, seq, q, q_res, h, positions, tokens, caches, step
            )
        # Back to each query's position on the rotary dims (K = V carried the keys' turns).
        out = rotate_pairs(out, cos, -sin)
        g = self.fields.o_groups
        grouped = torch.bmm(out.reshape(t, g, -1).transpose(0, 1), a.o_a)  # [g, T, o_lora]
        return apply(roles, a.o_b, grouped.transpose(0, 1).reshape(t, -1))

    def _attend_one(
        self,
        i: int,
        a: V4Attention,
        seq: SequenceRows,
        q: torch.Tensor,  # [T, Nh, D], rotated
        q_res: torch.Tensor,  # [T, q_lora]
        h: torch.Tensor,  # [T, H]
        positions: torch.Tensor,
        tokens: torch.Tensor,  # [T, token dims]
        caches: tuple[torch.Tensor, torch.Tensor],
        step: CompressedMetadata,
    ) -> torch.Tensor:  # [n, Nh, D]
        f, d = self.fields, self.config.head_dim
        token_pages, entry_pages = caches
        bs, rows = step.block_size, slice(seq.row_start, seq.row_end)
        start, end = seq.start_pos, seq.context_len
        write_tokens(token_pages, seq, tokens[rows], bs)
        rate = f.rate(i)
        # What this step reads of the window: its attention's, and the compression windows
        # that end in it (CSA: the one before each too).
        low = start - f.sliding_window + 1
        if rate:
            low = min(low, (start // rate - (1 if a.indexer is not None else 0)) * rate)
        low = max(low, 0)
        stream = read_tokens(token_pages, seq, low, end, bs)  # [end - low, token dims]
        pos = positions[rows]  # [n]
        keys = stream[:, :d]
        key_pos = torch.arange(low, end, device=q.device)
        visible = (key_pos.unsqueeze(0) <= pos.unsqueeze(1)) & (
            key_pos.unsqueeze(0) > pos.unsqueeze(1) - f.sliding_window
        )  # [n, end - low]
        if rate:
            first, done = start // rate, end // rate  # entries this step completes
            if done > first:
                made = self._entries(a, stream, low, first, done, rate)
                write_entries(entry_pages, seq, first, made, rate, step.entry_span)
            if done:
                entries = read_entries(entry_pages, seq, done, rate, step.entry_span)
                ready = torch.arange(done, device=q.device).unsqueeze(0) < (
                    (pos + 1) // rate
                ).unsqueeze(1)  # [n, done]: the windows that ended by each query
                if a.indexer is not None:
                    top, chosen = self._choose(
                        a.indexer, q_res[rows], h[rows], pos, entries[:, d:], ready
                    )
                    if done > f.index_topk:  # sparse: each query reads its own top k
                        return self._sparse_attend(
                            q[rows], keys, visible, entries[:, :d], top, chosen, a.sinks
                        )
                    ready = torch.zeros_like(ready).scatter_(1, top, chosen)
                keys = torch.cat((keys, entries[:, :d]), dim=0)
                visible = torch.cat((visible, ready), dim=1)
        return self._softmax_attend(q[rows], keys, visible, a.sinks)

    def _entries(
        self, a: V4Attention, stream: torch.Tensor, low: int, first: int, done: int, rate: int
    ) -> torch.Tensor:  # [done - first, entry dims]
        """Entries ``first .. done - 1`` from the window's pages (positions from ``low``)."""
        d = self.config.head_dim
        assert a.compressor is not None
        comp = self._compress(a.compressor, stream, d, d, low, first, done, rate)
        if a.indexer is None:
            return comp
        idim = self.fields.index_head_dim
        at = 5 * d  # the indexer's projections follow the window's and the compressor's
        index = self._compress(a.indexer.compressor, stream, at, idim, low, first, done, rate)
        return torch.cat((comp, index), dim=-1)

    def _compress(
        self,
        comp: Compressor,
        stream: torch.Tensor,  # [positions from low, token dims]
        start_col: int,  # the column of the stream where this compressor's kv starts
        dim: int,
        low: int,
        first: int,
        done: int,
        rate: int,
    ) -> torch.Tensor:  # [done - first, dim]
        """Entries ``first .. done - 1``: each window's (CSA: two windows') kv, weighed by the
        softmax of its gate plus the place bias, summed, normed and rotated."""
        copies = comp.bias.shape[1] // dim
        kv_cols = stream[:, start_col : start_col + copies * dim]
        gate_cols = stream[:, start_col + copies * dim : start_col + 2 * copies * dim]
        windows = torch.arange(first, done, device=stream.device)
        places = torch.arange(rate, device=stream.device)
        rows = (windows.unsqueeze(1) * rate + places - low).flatten()  # this window's tokens
        kv = kv_cols[rows].view(-1, rate, copies * dim)
        gate = gate_cols[rows].view(-1, rate, copies * dim) + comp.bias  # float32
        if copies == 2:  # CSA: the previous window's Ca, then this one's Cb
            prev = rows - rate
            has_prev = (windows > 0).repeat_interleave(rate)
            prev = torch.where(has_prev, prev, torch.zeros_like(prev))
            kv_a = kv_cols[prev][:, :dim].view(-1, rate, dim)
            gate_a = gate_cols[prev][:, :dim].view(-1, rate, dim) + comp.bias[:, :dim]
            first_window = ~has_prev.view(-1, rate)[:, :1].unsqueeze(-1)  # [w, 1, 1]
            kv_a = kv_a.masked_fill(first_window, 0.0)
            gate_a = gate_a.masked_fill(first_window, float("-inf"))
            kv = torch.cat((kv_a, kv[..., dim:]), dim=1)  # [w, 2 rate, dim]
            gate = torch.cat((gate_a, gate[..., dim:]), dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        made = self._rms((kv * weights).sum(dim=1), comp.norm)  # [w, dim]
        at_pos = windows * rate
        cos, sin = self.compress_rope[0][at_pos], self.compress_rope[1][at_pos]
        return rotate_pairs(made, cos, sin)

    def _choose(
        self,
        ix: Indexer,
        q_res: torch.Tensor,  # [n, q_lora]
        h: torch.Tensor,  # [n, H]
        pos: torch.Tensor,  # [n]
        keys: torch.Tensor,  # [entries, index dims]
        ready: torch.Tensor,  # [n, entries] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's top ``index_topk`` of the ready entries, per query: their indices
        [n, k] and which of them are ready [n, k] (a query with fewer ready entries than k
        gets some that are not)."""
        f, n = self.fields, q_res.shape[0]
        cos = self.compress_rope[0][pos].unsqueeze(1)
        sin = self.compress_rope[1][pos].unsqueeze(1)
        iq = rotate_pairs(ix.q(q_res).view(n, f.index_heads, f.index_head_dim), cos, sin)
        scores = torch.matmul(iq.float(), keys.t().float())  # [n, heads, entries]
        scores = F.relu(scores) * f.index_head_dim**-0.5
        weights = ix.weights(h).float() * f.index_heads**-0.5  # [n, heads]
        total = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~ready, float("-inf"))
        # Ties (entries every head's ReLU zeroes score exactly 0) go to the earlier entry:
        # the same choice however the prompt was chunked (torch.topk's tie order changes
        # with the row's length; transformers leaves it to that).
        order = total.sort(dim=-1, descending=True, stable=True).indices
        top = order[:, : min(f.index_topk, total.shape[1])]
        return top, ready.gather(1, top)

    def _softmax_attend(
        self,
        q: torch.Tensor,  # [n, Nh, D]
        keys: torch.Tensor,  # [K, D], also the values
        visible: torch.Tensor,  # [n, K] bool
        sinks: torch.Tensor,  # [Nh] float32
    ) -> torch.Tensor:  # [n, Nh, D]
        nh, n = q.shape[1], q.shape[0]
        scores = torch.matmul(q.transpose(0, 1), keys.t()) * self.config.head_dim**-0.5
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))  # [Nh, n, K]
        # With the (float32) sink the softmax runs in float32, as transformers promotes it.
        sink = sinks.view(nh, 1, 1).expand(nh, n, 1)
        logits = torch.cat((scores.float(), sink), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)

    def _sparse_attend(
        self,
        q: torch.Tensor,  # [n, Nh, D]
        window: torch.Tensor,  # [W, D]: the window's keys, also its values
        visible: torch.Tensor,  # [n, W] bool
        entries: torch.Tensor,  # [E, D]
        top: torch.Tensor,  # [n, k] int64: each query's chosen entries
        chosen: torch.Tensor,  # [n, k] bool: those that are ready
        sinks: torch.Tensor,  # [Nh] float32
    ) -> torch.Tensor:  # [n, Nh, D]
        """Attention over the window and each query's own ``k`` entries, gathered: the cost
        of a query grows with ``index_topk``, not with the entries there are. Queries go
        ``_SPARSE_ROWS`` at a time, so the gathered keys stay within
        ``_SPARSE_ROWS x k x D``."""
        out = torch.empty_like(q)
        nh, scale = q.shape[1], self.config.head_dim**-0.5
        for a in range(0, q.shape[0], _SPARSE_ROWS):
            b = min(a + _SPARSE_ROWS, q.shape[0])
            qs = q[a:b].transpose(0, 1)  # [Nh, m, D]
            picked = entries[top[a:b]]  # [m, k, D]
            near = torch.matmul(qs, window.t()) * scale  # [Nh, m, W]
            near = near.masked_fill(~visible[a:b].unsqueeze(0), float("-inf"))
            far = torch.einsum("hmd,mkd->hmk", qs, picked) * scale
            far = far.masked_fill(~chosen[a:b].unsqueeze(0), float("-inf"))
            sink = sinks.view(nh, 1, 1).expand(nh, b - a, 1)
            logits = torch.cat((near.float(), far.float(), sink), dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1).to(window.dtype)
            w = window.shape[0]
            mixed = torch.matmul(probs[..., :w], window)  # [Nh, m, D]
            mixed = mixed + torch.einsum("hmk,mkd->hmd", probs[..., w:-1], picked)
            out[a:b] = mixed.transpose(0, 1)
        return out

    # ------------------------------------------------------------------ experts
    def _moe(
        self, e: V4Experts, h: torch.Tensor, input_ids: torch.Tensor, roles: RowRoles | None
    ) -> torch.Tensor:
        f = self.fields
        scores = F.linear(h, e.router)  # [T, E], the model's dtype, as transformers scores
        scores = F.softplus(scores).sqrt() if f.scoring == "sqrtsoftplus" else scores.sigmoid()
        if e.table is not None:
            index = e.table[input_ids]
        else:
            assert e.bias is not None
            choice = scores + e.bias
            index = torch.topk(choice, f.experts_per_token, dim=-1, sorted=False).indices
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * f.routed_scaling_factor
        routed = grouped_experts(
            h, index, weights, len(e.experts), lambda x, rows: self._gated(e.experts[x], rows, None)
        )
        return routed + self._gated(e.shared, h, roles)

    def _gated(
        self, mlp: tuple[Linear, Linear], h: torch.Tensor, roles: RowRoles | None
    ) -> torch.Tensor:
        limit = self.fields.swiglu_limit
        gate_up, down = mlp
        gate, up = apply(roles, gate_up, h).chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return apply(roles, down, F.silu(gate) * up)


# ---------------------------------------------------------------------- config and weights


def deepseek_v4_weights(
    arch: Architecture, config: ModelConfig
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight ``DeepseekV4Model`` reads, under DeepSeek's own names (``hf_name``)."""
    f = _fields(config)
    h, nh, d, n = config.hidden_size, config.num_heads, config.head_dim, f.hc_mult
    inter, e = f.moe_intermediate_size, f.num_experts
    yield "model.embed_tokens.weight", (config.vocab_size, h)

    def mlp(p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield p + "w1.weight", (inter, h)
        yield p + "w2.weight", (h, inter)
        yield p + "w3.weight", (inter, h)

    def compressor(
        p: str, dim: int, copies: int, rate: int
    ) -> Iterator[tuple[str, tuple[int, ...]]]:
        yield p + "ape", (rate, copies * dim)
        yield p + "norm.weight", (dim,)
        yield p + "wgate.weight", (copies * dim, h)
        yield p + "wkv.weight", (copies * dim, h)

    for i, kind in enumerate(f.layer_types):
        p = f"model.layers.{i}."
        a = p + "attn."
        yield a + "attn_sink", (nh,)
        yield a + "wq_a.weight", (f.q_lora_rank, h)
        yield a + "q_norm.weight", (f.q_lora_rank,)
        yield a + "wq_b.weight", (nh * d, f.q_lora_rank)
        yield a + "wkv.weight", (d, h)
        yield a + "norm.weight", (d,)
        yield a + "wo_a.weight", (f.o_groups * f.o_lora_rank, nh * d // f.o_groups)
        yield a + "wo_b.weight", (h, f.o_groups * f.o_lora_rank)
        if kind == CSA:
            yield from compressor(a + "compressor.", d, 2, f.csa_rate)
            yield from compressor(a + "indexer.compressor.", f.index_head_dim, 2, f.csa_rate)
            yield a + "indexer.wq_b.weight", (f.index_heads * f.index_head_dim, f.q_lora_rank)
            yield a + "indexer.weights_proj.weight", (f.index_heads, h)
        elif kind == HCA:
            yield from compressor(a + "compressor.", d, 1, f.hca_rate)
        yield p + "ffn.gate.weight", (e, h)
        if f.hashed[i]:
            yield p + "ffn.gate.tid2eid", (config.vocab_size, f.experts_per_token)
        else:
            yield p + "ffn.gate.bias", (e,)
        for x in range(e):
            yield from mlp(f"{p}ffn.experts.{x}.")
        yield from mlp(p + "ffn.shared_experts.")
        yield p + "attn_norm.weight", (h,)
        yield p + "ffn_norm.weight", (h,)
        for kind_ in ("attn", "ffn"):
            yield f"{p}hc_{kind_}_fn", ((2 + n) * n, n * h)
            yield f"{p}hc_{kind_}_base", ((2 + n) * n,)
            yield f"{p}hc_{kind_}_scale", (3,)
    yield "hc_head_fn", (n, n * h)
    yield "hc_head_base", (n,)
    yield "hc_head_scale", (1,)
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)


_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def deepseek_v4_hf_name(name: str) -> str:
    """DeepSeek's tensor names as its checkpoints and transformers' ``save_pretrained`` write
    them (with or without ``model.``), as ``deepseek_v4_weights`` lists them."""
    bare = name.removeprefix("model.")
    if bare in _TOP_NAMES:
        return _TOP_NAMES[bare]
    if bare.startswith("layers."):
        return "model." + bare
    return bare


def deepseek_v4_unused_weight(config: ModelConfig, name: str) -> bool:
    """The multi-token-prediction layers (``mtp.*``, and layers past the last)."""
    if name.startswith("mtp."):
        return True
    if not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    return index.isdigit() and int(index) >= config.num_layers


#: transformers' defaults (``DeepseekV4Config``) for the keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "head_dim": 512,
    "sliding_window": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
}


def deepseek_v4_hf_fields(raw: Mapping[str, Any], file: str) -> dict[str, Any]:
    """transformers' ``deepseek_v4`` config.json, with its legacy spellings and defaults."""
    raw = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    n = positive_int(raw, "num_hidden_layers", file)
    head_dim = positive_int(raw, "head_dim", file)
    rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
    if raw.get("compress_rate_csa"):
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca"):
        rates[HCA] = raw["compress_rate_hca"]
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        types = [_RATE_TYPES.get(r, str(r)) for r in raw["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    if len(types) != n or set(types) - {CSA, HCA, SLIDING}:
        raise CorruptWeights(f"{file}: layer_types {types!r} for {n} layers", path=file)
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        hashed = raw.get("num_hash_layers")
        hashed = 3 if hashed is None else hashed
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    mlp_types = list(mlp_types)[:n]
    if len(mlp_types) != n or set(mlp_types) - {"hash_moe", "moe"}:
        raise CorruptWeights(f"{file}: mlp_layer_types {mlp_types!r} for {n} layers", path=file)
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        partial = raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim") else 64 / 512
    rope_dim = int(head_dim * partial)
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise UnsupportedModel(f"{file}: scoring_func {scoring!r} is not supported", path=file)
    if raw.get("num_key_value_heads", 1) != 1:
        raise UnsupportedModel(f"{file}: DeepSeek-V4 with more than one KV head", path=file)
    main_theta, compress_theta, compress_scaling = _v4_rope(raw, file)
    heads = positive_int(raw, "num_attention_heads", file)
    groups = positive_int(raw, "o_groups", file)
    if heads * head_dim % groups or rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise CorruptWeights(
            f"{file}: o_groups {groups} and {rope_dim} rotary dims do not fit {heads} heads of "
            f"{head_dim}",
            path=file,
        )
    fields = V4Fields(
        q_lora_rank=positive_int(raw, "q_lora_rank", file),
        rope_dim=rope_dim,
        o_groups=groups,
        o_lora_rank=positive_int(raw, "o_lora_rank", file),
        sliding_window=positive_int(raw, "sliding_window", file),
        layer_types=tuple(types),
        csa_rate=positive_int(rates, CSA, file),
        hca_rate=positive_int(rates, HCA, file),
        compress_theta=float(compress_theta),
        compress_scaling=compress_scaling,
        hc_mult=positive_int(raw, "hc_mult", file),
        hc_iters=positive_int(raw, "hc_sinkhorn_iters", file),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        hashed=tuple(t == "hash_moe" for t in mlp_types),
        num_experts=positive_int(raw, "n_routed_experts", file),
        experts_per_token=positive_int(raw, "num_experts_per_tok", file),
        moe_intermediate_size=positive_int(raw, "moe_intermediate_size", file),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        scoring=scoring,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        index_heads=positive_int(raw, "index_n_heads", file),
        index_head_dim=positive_int(raw, "index_head_dim", file),
        index_topk=positive_int(raw, "index_topk", file),
    )
    if fields.experts_per_token > fields.num_experts:
        raise CorruptWeights(f"{file}: more experts a token than experts", path=file)
    return {
        "arch_fields": fields,
        "head_dim": head_dim,
        "num_kv_heads": 1,
        "intermediate_size": fields.moe_intermediate_size,
        "rope": (main_theta, None),
        "layer_types": (),  # every layer's window is its own (``V4Fields``)
    }


def _v4_rope(raw: Mapping[str, Any], file: str) -> tuple[Any, Any, RopeScaling | None]:
    """(main theta, compressed layers' theta, their scaling): the sliding-only layers rotate
    plainly; the compressed ones by another base, with YaRN where set (its cos/sin factor 1,
    as DeepSeek's reference has it)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise CorruptWeights(f"{file}: rope_parameters must be an object", path=file)
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = dict(params["main"]), dict(params["compress"])
        main.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        compress.setdefault("rope_theta", raw.get("compress_rope_theta", 160000.0))
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
    if main.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"{file}: DeepSeek-V4's main rope must be plain", path=file)
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    max_pos = raw.get("max_position_embeddings")
    theta, scaling = read_rope(
        {"rope_parameters": compress, "max_position_embeddings": max_pos}, file
    )
    return main.get("rope_theta", 10000.0), theta, scaling


def deepseek_v4_export_hf(c: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
    """None: DeepSeek-V4 is only read from its own Hugging Face directory, never written."""
    raise UnsupportedModel(
        "DeepSeek-V4 is served from its Hugging Face directory; there is nothing to export",
        path="<config>",
    )


DEEPSEEK_V4 = Architecture(
    "deepseek_v4",
    ("deepseek_v4",),
    None,  # no GGUF layout of it is read
    "DeepseekV4ForCausalLM",
    DeepseekV4Model,
    deepseek_v4_weights,
    hf_fields=deepseek_v4_hf_fields,
    hf_name=deepseek_v4_hf_name,
    export_hf=deepseek_v4_export_hf,
    unused_weight=deepseek_v4_unused_weight,
)
ARCHITECTURES = (DEEPSEEK_V4,)
