"""The model runner: turns a SchedulerOutput into one flat batch, runs the model, samples.

With the model, the only tensor code in the engine.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from kvgate.engine.messages import (
    NewRequestData,
    RunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprobs,
)
from kvgate.engine.sampler import Sampler, SamplingState
from kvgate.engine.step_handle import RunnerStep
from kvgate.engine.verify import Drafted, DraftVerifier
from kvgate.model.attention import AttentionMetadata
from kvgate.model.compressed_kv import compressed_views
from kvgate.model.kv_layout import KVGroup, KVLayout
from kvgate.model.lora import LoraAdapter, LoraRows
from kvgate.model.protocol import Model
from kvgate.model.row_roles import RowRoles
from kvgate.sampling_params import SamplingParams
from kvgate.structured.compiler import GrammarCompiler
from kvgate.structured.masks import MaskBuilder

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(
    layout: KVLayout,
    num_layers: int,
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> KVCaches:
    """One (K, V) pair per layer, of the attention backend's cache ``shapes`` (K's, V's: an
    empty V where the spec keeps none): a pair per slot of the layout, shared by the layers
    of every group in that slot (a block belongs to one group at a time). Compressed layers
    (``layout.specs``): views of one pool per layer (``compressed_kv.compressed_views``), of
    as many blocks as K's shape has."""
    k_shape, v_shape = shapes
    if layout.specs:
        item = torch.empty((), dtype=dtype).element_size()
        block_size = k_shape[1]
        pool = _zeros((k_shape[0], layout.block_bytes(block_size) // item), dtype, device)
        return compressed_views(layout, pool, block_size)
    slots = [
        (_zeros(k_shape, dtype, device), _zeros(v_shape, dtype, device))
        for _ in range(layout.slots)
    ]
    return [slots[slot] for _, slot in layout.layer_slots(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU, fresh anonymous pages (page-aligned, zero by the
    kernel's promise): nothing is written at start, so a 2 GiB pool costs no start-up time
    (``torch.zeros`` took ~1 s on 2 cores) and becomes resident only as blocks are used."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes)  # the tensor keeps it alive (torch.frombuffer)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


@dataclass
class _RequestState:
    """What the runner remembers of a request between steps (survives preemption)."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    #: The grammar's state after every output token (constrained requests). It lives here,
    #: not in the KV cache, so it survives preemption and recompute unchanged.
    matcher: llguidance.LLMatcher | None = None
    #: The request's LoRA adapter (None: the base model alone).
    lora: LoraAdapter | None = None


@dataclass
class _StepTokens:
    """A step's ``RunnerOutput`` while it is being filled in."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    accepted_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    grammar_complete: set[str] = field(default_factory=set)
    grammar_failed: dict[str, str] = field(default_factory=dict)

    def output(self) -> RunnerOutput:
        return RunnerOutput(
            sampled_token_ids=self.sampled_token_ids,
            logprobs=self.logprobs,
            accepted=self.accepted,
            accepted_logprobs=self.accepted_logprobs,
            grammar_complete=frozenset(self.grammar_complete),
            grammar_failed=self.grammar_failed,
        )


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    #: Per layer: its group's view of the step (slots, block tables from the first block
    #: its window reads).
    meta: tuple[AttentionMetadata, ...]
    sample_rows: torch.Tensor  # [S] row of the last token of each sampling sequence
    sample_ids: tuple[str, ...]  # request id of each sampling row, in order
    #: The prompt rows, where the model's linears depend on it (``Model.prompt_tiles``):
    #: rows at positions below their request's prompt length. None: none, or it does not.
    roles: RowRoles | None = None
    #: The speculating sequences' drafts (every row of theirs is in ``sample_rows``).
    drafts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: Each row's LoRA adapter (``LoraRows``); None where no row has one.
    lora: LoraRows | None = None


class ModelRunner:
    def __init__(
        self,
        model: Model,
        kv_caches: KVCaches,
        block_size: int,
        sampler: Sampler | None = None,
        grammars: GrammarCompiler | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        """``grammars``: compiles constrained requests' grammars (None: none may come);
        ``layout``: the KV groups (None: one group of every layer)."""
        self.model = model
        n = model.config.num_layers
        self.layout = layout or KVLayout((KVGroup(tuple(range(n)), None),), n)
        self._layer_group = [g for g, _ in self.layout.layer_slots(n)]
        self.grammars = grammars
        self._masks: MaskBuilder | None = None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self.sampler = sampler or Sampler()
        self.states: dict[str, _RequestState] = {}

    def start(self, out: SchedulerOutput, pause: bool = False) -> RunnerStep:
        """Begin one step: its requests' state is updated and its batch built now; its
        forward and sampling run as the returned handle is advanced (``step_handle.py``).
        ``pause``: suspend the forward between each two layers (``Model.stepwise``), so its
        owner may run a whole other step there."""
        for rid in out.finished_request_ids:
            self.states.pop(rid, None)
        for new in out.new_requests:
            self._remember(new)
        if out.is_empty:
            return RunnerStep.done(RunnerOutput(sampled_token_ids={}))
        batch = self.build_batch(out.sequences)
        # Constrained rows' masks are computed on llguidance's threads during the forward
        # (a speculating request's rows one by one after it: ``verify.py``).
        plain = [(i, rid) for i, rid in enumerate(batch.sample_ids) if rid not in batch.drafts]
        guided = [
            (row, matcher)
            for row, (_, rid) in enumerate(plain)
            if (matcher := self.states[rid].matcher) is not None
        ]
        masks = self._mask_builder().start([m for _, m in guided]) if guided else None
        allowed = None if masks is None else ([row for row, _ in guided], masks)
        return RunnerStep(self._run(batch, [rid for _, rid in plain], allowed, pause))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one whole step, without pauses."""
        return self.start(out).finish()

    def _run(
        self,
        batch: FlatBatch,
        plain: list[str],
        guided: tuple[list[int], Future[np.ndarray]] | None,
        pause: bool,
    ) -> Generator[None, None, RunnerOutput]:
        """The step's forward (pausing between layers with ``pause``), then its tokens:
        ``plain``: the sequences sampling one token (in ``batch.sample_ids`` order, drafts
        left out); ``guided``: their constrained rows (indices into ``plain``) and the masks
        being computed for them."""
        if batch.lora is None:
            hidden = yield from self.model.stepwise(
                batch.input_ids, batch.positions, self.kv_caches, batch.meta, pause, batch.roles
            )
        else:  # only a model that supports LoRA gets adapters (``LoraCache``)
            stepwise: Callable[..., Generator[None, None, torch.Tensor]] = self.model.stepwise
            hidden = yield from stepwise(
                batch.input_ids, batch.positions, self.kv_caches, batch.meta, pause,
                batch.roles, lora=batch.lora,
            )  # fmt: skip
        if not batch.sample_ids:
            return RunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        result = _StepTokens()
        if plain:
            rows = logits
            if batch.drafts:
                index = [i for i, rid in enumerate(batch.sample_ids) if rid not in batch.drafts]
                rows = logits.index_select(0, torch.tensor(index, device=logits.device))
            allowed = None if guided is None else (guided[0], guided[1].result())
            self._sample(rows, plain, allowed, result)
        if batch.drafts:
            self._verify(logits, batch, result)
        return result.output()

    def _remember(self, new: NewRequestData) -> None:
        gen = None
        if new.params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(new.params.seed)
        state = _RequestState(new.prompt_token_ids, new.params, gen, lora=new.lora)
        if new.matcher is not None:
            state.matcher = new.matcher
        elif new.params.grammar is not None:  # made without its matcher: build it here
            if self.grammars is None:
                raise RuntimeError("a constrained request reached a runner without grammars")
            state.matcher = self.grammars.matcher(new.params.grammar)
        self.states[new.request_id] = state

    def _sample(
        self,
        logits: torch.Tensor,
        ids: list[str],
        allowed: tuple[list[int], np.ndarray] | None,
        result: _StepTokens,
    ) -> None:
        """One token for each of ``ids`` (one row of ``logits`` each), into ``result``."""
        sampling = [self._sampling_state(rid) for rid in ids]
        sampled = self.sampler(logits, sampling, allowed)
        for i, rid in enumerate(ids):
            token = sampled.token_ids[i]
            result.sampled_token_ids[rid] = token
            state = self.states[rid]
            state.output_token_ids.append(token)
            if state.matcher is not None:
                state.matcher.consume_token(token)
                if state.matcher.is_error():  # never expected under the mask
                    result.grammar_failed[rid] = state.matcher.get_error()
                elif state.matcher.is_stopped():  # complete: nothing may follow
                    result.grammar_complete.add(rid)
            lp = sampled.logprobs[i]
            if lp is not None:
                result.logprobs[rid] = lp

    def _verify(self, logits: torch.Tensor, batch: FlatBatch, result: _StepTokens) -> None:
        """The speculating requests' tokens: the draft tokens the model accepts, then one
        of its own (``verify.py``), into ``result``."""
        drafted = []
        for rid, draft in batch.drafts.items():
            s = self.states[rid]
            drafted.append(
                Drafted(
                    rid, draft, batch.sample_ids.index(rid), s.params, s.generator,
                    s.prompt_token_ids, s.output_token_ids, s.matcher,
                )
            )  # fmt: skip
        verifier = DraftVerifier(self.sampler, self._mask_builder)
        for rid, got in verifier(logits, drafted).items():
            *accepted, result.sampled_token_ids[rid] = got.tokens
            if accepted:
                result.accepted[rid] = tuple(accepted)
            *lps, last = got.logprobs
            if last is not None:
                result.logprobs[rid] = last
                result.accepted_logprobs[rid] = tuple(lp for lp in lps if lp is not None)
            if got.failed is not None:
                result.grammar_failed[rid] = got.failed
            elif got.complete:
                result.grammar_complete.add(rid)

    def _mask_builder(self) -> MaskBuilder:
        if self._masks is None:
            assert self.grammars is not None
            self._masks = MaskBuilder(self.grammars.vocab_size)
        return self._masks

    def _sampling_state(self, request_id: str) -> SamplingState:
        s = self.states[request_id]
        return SamplingState(
            params=s.params,
            generator=s.generator,
            prompt_token_ids=s.prompt_token_ids,
            output_token_ids=s.output_token_ids,
        )

    def build_batch(self, sequences: tuple[ScheduledSequence, ...]) -> FlatBatch:
        """Decodes first (one row each, batched attention; a speculating sequence's rows
        are decodes too, each at its own position), then prefill chunks."""
        decodes = [s for s in sequences if s.is_decode]
        prefills = [s for s in sequences if not s.is_decode]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        is_prompt: list[bool] = []
        drafts: dict[str, tuple[int, ...]] = {}
        adapters: list[LoraAdapter | None] = []
        for seq in decodes + prefills:
            input_ids += seq.token_ids
            state = self.states.get(seq.request_id)  # tests build batches of bare sequences
            adapters += [None if state is None else state.lora] * seq.num_tokens
            positions += range(seq.start_pos, seq.context_len)
            if self.model.prompt_tiles:
                prompt_len = len(self.states[seq.request_id].prompt_token_ids)
                is_prompt += [p < prompt_len for p in range(seq.start_pos, seq.context_len)]
            if seq.num_draft:
                drafts[seq.request_id] = seq.draft
                sample_rows += range(len(input_ids) - seq.num_tokens, len(input_ids))
                sample_ids += [seq.request_id] * seq.num_tokens
            elif seq.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(seq.request_id)
        dev = self.device
        build = self.model.attention.build_metadata
        metas = [
            build(g, group, decodes, prefills, self.block_size, self.device)
            for g, group in enumerate(self.layout.groups)
        ]
        return FlatBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=tuple(metas[g] for g in self._layer_group),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sample_ids=tuple(sample_ids),
            roles=RowRoles.of(is_prompt),
            drafts=drafts,
            lora=LoraRows.of(adapters, dev),
        )
