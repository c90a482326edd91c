"""The synchronous engine: add requests, then ``step()`` = schedule -> run -> update."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

import kvgate
from kvgate.config import EngineConfig, available_memory_bytes, parse_memory
from kvgate.engine.autopilot import Autopilot, SloPolicy
from kvgate.engine.detokenizer import IncrementalDetokenizer
from kvgate.engine.disk_tier import DiskTier
from kvgate.engine.disk_tier import default_dir as default_tier_dir
from kvgate.engine.drafter import NgramDrafter
from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.kv_transfer import (
    BlockCopier,
    TierIO,
    block_axis,
    model_code_digest,
    tier_format,
)
from kvgate.engine.lineage import VERSIONED_SETTINGS, weights_digest
from kvgate.engine.lora_cache import LoraCache
from kvgate.engine.messages import RunnerOutput, SchedulerOutput, TokenLogprobs
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import SchedulingPolicy, TenantShare
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.request_factory import RequestFactory
from kvgate.engine.runner import ModelRunner, allocate_kv_caches
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import (
    FinishedRequestStats,
    IterationStats,
    RequestMetrics,
    StatsListener,
    TenantLedger,
)
from kvgate.engine.step_handle import RunnerStep
from kvgate.errors import (
    DuplicateRequestId,
    InvalidConfig,
    KVCacheTooSmall,
)
from kvgate.model.attention_backends import BackendOptions, select_backend
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.cpu_kernels import CpuKernels
from kvgate.model.kv_layout import KVLayout
from kvgate.model.models import model_class
from kvgate.model.precision import (
    dequantized,
    native_blocks,
    native_blocks_min_bytes,
    resolve_dtype,
    upcast_attention,
)
from kvgate.sampling_params import SamplingParams
from kvgate.structured.compiler import GrammarCompiler
from kvgate.tokenizer import Tokenizer

log = logging.getLogger("kvgate.engine")

#: How long a step with nothing but loads from the KV tier in flight waits for one to end.
_LOAD_WAIT_S = 0.005


@dataclass(frozen=True)
class KVPoolInfo:
    num_blocks: int
    block_size: int
    bytes: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class EngineStep:
    """A step in flight (``LLMEngine.begin_step``); its owner advances it and ends it
    (``LLMEngine.end_step``)."""

    sched: SchedulerOutput
    stats: IterationStats
    t0: float
    #: The runner's step (None: it failed to start; ``error`` says why).
    runner: RunnerStep | None = None
    #: What failed the step; its requests end with an error when it ends.
    error: Exception | None = None
    #: An urgent step ran at one of its pauses (``LLMEngine.step_urgent``).
    urgent_ran: bool = False
    #: Ended (``LLMEngine.end_step``).
    done: bool = False

    def advance(self) -> bool:
        """Run the step up to its next pause between two layers. True: paused, with more
        to run; False: nothing left to pause at (``end_step`` runs the rest)."""
        if self.runner is None or self.error is not None or self.done:
            return False
        try:
            return self.runner.advance()
        except Exception as exc:  # the step fails its requests when it ends
            self.error = exc
            return False

    def fail(self, exc: Exception) -> None:
        """Abandon the step where it stands: it fails its requests when it ends."""
        if self.error is None:
            self.error = exc
        if self.runner is not None:
            self.runner.close()


@dataclass
class _OutputState:
    """Per-request output bookkeeping: detokenizer and what was already reported."""

    detokenizer: IncrementalDetokenizer
    num_reported_tokens: int = 0
    #: Output tokens already given to the detokenizer and counted in the step stats.
    num_seen: int = 0
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLMEngine:
    """``listeners`` receive an ``IterationStats`` after every step (metrics exporters);
    ``policy`` orders and entitles requests (FIFO when None; see ``engine/policy``)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        listeners: Sequence[StatsListener] = (),
        policy: SchedulingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        #: The engine's time (``time.monotonic`` seconds): steps, latencies, the autopilot's
        #: windows. Tests drive a virtual one.
        self.clock = clock
        self.listeners: list[StatsListener] = list(listeners)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        # Raises at once (naming the missing CPU flags) for a KVGATE_CPU_ISA above this CPU.
        kernels = CpuKernels.probe(enabled=config.native_kernels and self.device.type == "cpu")
        self.dtype, why = resolve_dtype(config.dtype, self.device, kernels)
        t0 = time.perf_counter()
        log.info("loading weights of %r", config.model)
        # A GGUF's block-quantized matrices stay in their blocks where the block kernels are
        # built (quant_linear.py): under gguf_blocks native, or auto with dtype auto for a
        # model large enough to gain on this CPU's kernels (precision.native_blocks_min_bytes);
        # else they are dequantized.
        blocks = config.gguf_blocks
        keep_quantized = (
            config.quantization is None
            and kernels.quant is not None
            and (blocks == "native" or (blocks == "auto" and config.dtype == "auto"))
        )
        checkpoint = load_checkpoint(config.model, keep_quantized=keep_quantized)
        if keep_quantized and blocks == "auto":
            native, why_blocks = native_blocks(
                checkpoint.weights, native_blocks_min_bytes(kernels.paths())
            )
            log.info("weights: %s", why_blocks)
            if not native:
                checkpoint.weights = dequantized(checkpoint.weights)
        log.info(
            "weights read from %s in %.1f s; building the %s model (%s; %d layers)",
            checkpoint.path,
            time.perf_counter() - t0,
            str(self.dtype).removeprefix("torch."),
            why,
            checkpoint.config.num_layers,
        )
        self.model_config = checkpoint.config
        #: Where the weights were read from (a file or directory), for lineage.
        self.source = checkpoint.path
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.max_model_len = self._resolve_max_model_len()
        cls = model_class(checkpoint.config)
        #: Which layers share a block table (``kv_layout.py``), from each layer's KV spec as
        #: the model declares it, stored in the model's dtype: one group, or Gemma 3's
        #: global and sliding-window groups.
        kv_dtype = config.kv_cache_dtype
        if kv_dtype == "auto":
            kv_dtype = str(self.dtype).removeprefix("torch.")
        self.kv_layout = KVLayout.for_specs(
            [spec.with_dtype(kv_dtype) for spec in cls.kv_specs(checkpoint.config)],
            config.block_size,
        )
        assert self.kv_layout.spec is not None
        #: The attention backend the registry chose for the KV spec (``attention_backends``).
        self.attention_backend, attention = select_backend(
            self.kv_layout.spec,
            BackendOptions(
                num_heads=checkpoint.config.num_heads,
                device=self.device,
                scale=checkpoint.config.attention_scale,
                decode_kernel=kernels.attention,
                upcast=upcast_attention(self.dtype, self.device),
                layout=self.kv_layout,
                compute_dtype=self.dtype,
            ),
        )
        self.model = cls(
            checkpoint.config,
            checkpoint.weights,
            dtype=self.dtype,
            device=self.device,
            attention=attention,
            source=checkpoint.path,
            kernels=kernels,
            quantization=config.quantization,
        )
        #: What runs each op, for the start-up log and ``kvgate:build_info``.
        #: ``torch``: the vector level ATen dispatches to (pinned with a forced level too).
        self.build_info = self.model.build_info(kernels.level)
        if self.device.type == "cpu":
            self.build_info["torch"] = torch.backends.cpu.get_cpu_capability().lower()
        self.build_info["kv_backend"] = self.attention_backend
        self.build_info["kv_dtype"] = kv_dtype
        del checkpoint  # the float32 copies of the weights can go now
        self.load_seconds = time.perf_counter() - t0
        self.kv_pool = self._size_kv_pool()
        log.info(
            "model ready in %.1f s; allocating the KV pool: %d blocks x %d tokens = %d tokens "
            "(%.2f GiB, K/V stored as %s)",
            self.load_seconds,
            self.kv_pool.num_blocks,
            self.kv_pool.block_size,
            self.kv_pool.num_tokens,
            self.kv_pool.bytes / 2**30,
            kv_dtype,
        )
        num_blocks, attention = self.kv_pool.num_blocks, self.model.attention
        kv_caches = allocate_kv_caches(
            self.kv_layout,
            self.model_config.num_layers,
            # Compressed layers' pages are views of one pool the layout sizes.
            ((num_blocks, config.block_size), ())
            if self.kv_layout.specs
            else (
                attention.kv_cache_shape(num_blocks, config.block_size),
                attention.v_cache_shape(num_blocks, config.block_size),
            ),
            self.model.attention.kv_dtype,
            self.device,
        )
        if kv_caches and self.model.attention.native_layout(*kv_caches[0]) is None:
            # Whole native decode layers write and read only caches laid out for them (bf16
            # rows, or int8/fp8 rows with scales; not a cast to another float dtype, not
            # latent or compressed pages): elsewhere the per-op path runs.
            self.build_info["decode"] = "per-op"
        log.info("kernels: %s", ", ".join(f"{op}={path}" for op, path in self.build_info.items()))
        tier = self._open_tier()
        self.kv_cache = KVCacheManager(
            self.kv_pool.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            layout=self.kv_layout,
            roles_apart=self.model.prompt_tiles,
            tier=tier,
        )
        spec = config.speculative_config()
        #: Drafts for speculative decoding (``--speculative``); None: no request speculates.
        self.drafter = NgramDrafter(spec) if spec is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                num_spare_seqs=config.num_spare_seqs,
            ),
            self.kv_cache,
            policy,
            clock=clock,
            drafter=self.drafter,
        )
        #: Moves the scheduler's knobs to hold the tenants file's SLO targets (inert until
        #: ``update_shares`` hands it some).
        self.autopilot = Autopilot(
            self.scheduler.configured_knobs, self.scheduler.num_spare_slots, start=clock()
        )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        #: Compiles and caches constrained requests' grammars (the server checks them with
        #: it before admitting a request; the runner makes each request's matcher from it).
        self.grammars = GrammarCompiler(self.tokenizer, sorted(eos))
        self.requests = RequestFactory(
            self.tokenizer,
            self.model_config.vocab_size,
            self.max_model_len,
            self.grammars,
            self.eos_token_ids,
            speculative=self.drafter is not None,
        )
        #: LoRA adapters by name (``lora_cache.py``): ``--lora-modules`` loaded now (a bad
        #: one fails the start, naming it), more through ``LoraCache.register``.
        self.loras = LoraCache(
            self.model_config,
            parse_memory(config.max_lora_memory, 1),
            self._loras_in_use,
            supported=self.model.supports_lora,
            model_name=type(self.model).__name__,
            device=self.device,
        )
        for name, path in config.lora_modules:
            self.loras.register(name, path)
        self.runner = ModelRunner(
            self.model, kv_caches, config.block_size, grammars=self.grammars, layout=self.kv_layout
        )
        #: Moves blocks between the pool and the second KV tier (None: no tier).
        self.tier_io: TierIO | None = None
        if tier is not None:
            axis = block_axis(lambda n: attention.kv_cache_shape(n, config.block_size))
            groups = [g for g, _ in self.kv_layout.layer_slots(self.model_config.num_layers)]
            copier = BlockCopier(kv_caches, groups, axis)
            self.tier_io = TierIO(tier, copier, self.kv_cache.load_costs)
        self._outputs: dict[str, _OutputState] = {}
        self._aborted: list[RequestOutput] = []
        self.num_steps = 0
        self.last_batch_size = 0
        self.ledger = TenantLedger()
        #: Times ``recover`` ended every request after an unexpected error.
        self.num_recoveries = 0
        #: What other threads read of the engine: replaced whole, never changed in place.
        self.snapshot = EngineSnapshot.capture(self)

    # ------------------------------------------------------------------ set-up helpers
    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            return model_max
        if asked > model_max:
            raise InvalidConfig(
                f"max_model_len {asked} exceeds the model's context of {model_max} tokens",
                param="max_model_len",
            )
        return asked

    def _open_tier(self) -> DiskTier | None:
        """The second KV tier ``kv_tier`` names, in a folder named by this engine's KV format
        (``kv_transfer.tier_format``): blocks another model, KV dtype or weights version
        wrote are never found."""
        config = self.config
        if config.kv_tier == "none":
            return None
        if self.kv_layout.specs:
            raise InvalidConfig(
                "kv_tier disk does not serve compressed KV (DeepSeek-V4) yet", param="kv_tier"
            )
        if self.device.type != "cpu":
            raise InvalidConfig("kv_tier disk moves blocks of a CPU pool only", param="kv_tier")
        weights, _ = weights_digest(str(self.source))
        settings = {k: getattr(config, k) for k in VERSIONED_SETTINGS if k != "max_model_len"}
        fmt = tier_format(
            {
                "weights_sha256": weights,
                "model_config": dataclasses.asdict(self.model_config),
                "engine": settings,
                "kv_layout": repr(self.kv_layout),
                "kv_dtype": str(self.model.attention.kv_dtype),
                "backend": self.attention_backend,
                "kernels": self.build_info,
                "kvgate": kvgate.__version__,
                "code": model_code_digest(),
            }
        )
        root = config.kv_tier_dir or default_tier_dir()
        tier = DiskTier(root, fmt, parse_memory(config.kv_tier_size, 1))
        log.info(
            "KV tier: disk, %s, up to %.2f GiB (%d blocks there now)",
            tier.dir, tier.capacity_bytes / 2**30, tier.state().num_blocks,
        )  # fmt: skip
        return tier

    def close(self) -> None:
        """Write what the KV tier has pending (a clean shutdown keeps every cached block)."""
        if self.tier_io is not None:
            self.tier_io.close()

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks one request of ``num_tokens`` tokens holds at most (every group's)."""
        return self.kv_layout.max_blocks(
            num_tokens, self.config.block_size, self.config.max_num_batched_tokens
        )

    def _size_kv_pool(self) -> KVPoolInfo:
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[0]
        else:
            total = available_memory_bytes()
        budget = parse_memory(self.config.kv_cache_memory, total)
        # A block is a page of K and V for ``slots`` layers (every layer, with one group), in
        # the attention backend's layout and dtype.
        bytes_per_block = self.kv_layout.block_bytes(self.config.block_size)
        num_blocks = budget // bytes_per_block
        needed = self.kv_layout.max_blocks(
            self.max_model_len, self.config.block_size, self.config.max_num_batched_tokens
        )
        if num_blocks < needed:
            raise KVCacheTooSmall(
                f"kv_cache_memory={self.config.kv_cache_memory!r} gives {num_blocks} blocks of "
                f"{self.config.block_size} tokens, but one request of max_model_len="
                f"{self.max_model_len} needs {needed}; raise kv_cache_memory or lower "
                f"max_model_len",
                param="kv_cache_memory",
            )
        return KVPoolInfo(num_blocks, self.config.block_size, num_blocks * bytes_per_block)

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: bytes | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        queue_deadline: float | None = None,
    ) -> Request:
        """Validate and tokenize a request (``RequestFactory.make``). Thread-safe."""
        return self.requests.make(
            request_id,
            prompt,
            params,
            cache_salt=cache_salt,
            tenant=tenant,
            deadline=deadline,
            queue_deadline=queue_deadline,
        )

    def add(self, request: Request) -> None:
        """Queue a request built by ``make_request``."""
        if request.request_id in self.scheduler.requests or request.request_id in self._outputs:
            raise DuplicateRequestId(request.request_id)
        p = request.params
        if p.lora_name is not None and request.lora is None:
            request.lora = self.loras.acquire(p.lora_name)
            salt = self.loras.salt(p.lora_name)
            request.cache_salt = salt if request.cache_salt is None else request.cache_salt + salt
        detok = IncrementalDetokenizer(
            self.tokenizer.backend,
            request.prompt_token_ids,
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
        )
        self.scheduler.add_request(request)
        self._outputs[request.request_id] = _OutputState(detok)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> Request:
        request = self.make_request(request_id, prompt, params)
        self.add(request)
        return request

    def lora_op(self, name: str, path: str | None) -> None:
        """Register LoRA adapter ``name`` from directory ``path`` (loaded and checked now),
        or with ``path`` None forget it (``LoraCache``); requests using it keep it."""
        if path is None:
            self.loras.unregister(name)
        else:
            self.loras.register(name, path)

    def _loras_in_use(self) -> set[str]:
        """Names of the LoRA adapters requests in the scheduler use (never evicted)."""
        return {name for r in self.scheduler.requests.values() if (name := r.params.lora_name)}

    def abort(self, request_ids: Sequence[str]) -> None:
        """End requests at once; their blocks are free before this returns."""
        for request in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._aborted.append(self._final_output(request))

    def recover(self, exc: BaseException) -> list[Request]:
        """After an unexpected error in a step: end every request (their blocks freed, no
        text made: whatever failed may fail again), forget every cached prefix (its KV may
        be half written), and return the requests so their callers can be told."""
        self.num_recoveries += 1
        ids = list(self.scheduler.requests)
        ended = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        for request in ended:
            request.error = f"engine error: {type(exc).__name__}: {exc}"
        self._outputs.clear()
        self._aborted.clear()
        self.kv_cache.pool.reset_prefix_cache()
        self.kv_cache.drop_stores()
        self.publish()
        return ended

    def publish(self) -> None:
        """Take and publish the snapshot other threads read (``snapshot.py``); on the engine
        thread. Each step ends with one; whoever adds or aborts outside a step publishes once
        after a batch of them (``AsyncLLM`` after draining its commands)."""
        self.snapshot = EngineSnapshot.capture(self)

    # ------------------------------------------------------------------ the SLO autopilot
    def update_shares(
        self, shares: Mapping[str, TenantShare], default: TenantShare, slo: SloPolicy | None
    ) -> None:
        """A tenants-file (re)load: the fair policy's shares, and the autopilot's targets
        with the tenants' classes (``slo`` None: no targets, the knobs go back)."""
        update = getattr(self.scheduler.policy, "update", None)
        if update is not None:  # FIFO has no shares
            update(shares, default)
        ranks = {tenant: share.priority for tenant, share in shares.items()}
        self.autopilot.configure(slo or SloPolicy(), ranks, default.priority)
        self.scheduler.knobs = self.autopilot.knobs

    def steer(self, now: float) -> bool:
        """Let the autopilot judge the window that ended by ``now``, if one did, and hand
        the scheduler its knobs. True: a knob moved."""
        autopilot = self.autopilot
        if not autopilot.due(now):
            return False
        waiting = [
            (r.tenant, r.arrival_time)
            for r in self.scheduler.requests.values()
            if r.first_token_time is None
        ]
        moved = autopilot.tick(now, waiting) is not None
        self.scheduler.knobs = autopilot.knobs
        return moved

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One whole step: schedule, run, update (no pauses: nothing else runs inside it)."""
        return self.end_step(self.begin_step())

    def begin_step(self, *, pause: bool = False) -> EngineStep:
        """Schedule a step and start it; its owner advances it (``EngineStep.advance``) and
        ends it (``end_step``). ``pause``: the step stops between each two layers, where its
        owner may add requests and run an urgent step (``step_urgent``)."""
        t0 = self.clock()
        stats = IterationStats()
        self.steer(t0)
        for request in self.scheduler.expire():
            self._aborted.append(self._final_output(request))
        io = self.tier_io
        if io is not None:
            # Nothing else to run: wait for a load rather than spin through empty steps.
            idle = not self.scheduler.running and not len(self.scheduler.waiting)
            for done in io.poll(_LOAD_WAIT_S if idle and self.scheduler.loading else 0.0):
                self.scheduler.load_done(done.order, done.ok)
        sched = self.scheduler.schedule()
        if io is not None:
            for order in self.kv_cache.take_loads():
                io.load(order)
        for request in sched.refused:
            self._aborted.append(self._final_output(request))
        self.last_batch_size = stats.batch_size = len(sched.sequences)
        decodes = sum(1 for s in sched.sequences if s.is_decode)
        if sched.sequences:
            stats.phase = (
                "decode"
                if decodes == len(sched.sequences)
                else "prefill"
                if not decodes
                else "mixed"
            )
        return self._start(sched, stats, t0, pause)

    def step_urgent(self, step: EngineStep) -> list[RequestOutput]:
        """At a pause of ``step``: run the prefill of a request the policy calls urgent now,
        in a whole step of its own (``Scheduler.schedule_urgent``), and return its outputs
        (its first token). At most once per step; [] when there is nothing to do.

        Safe because the two steps share nothing: the urgent one takes only free blocks, and
        the step in flight resumes with its own activations and block tables. Aborts must
        wait for the step in flight to end (its blocks are in use), so only additions may
        have been applied meanwhile.
        """
        if step.urgent_ran or step.done:
            return []
        t0 = self.clock()
        sched = self.scheduler.schedule_urgent()
        if sched is None:
            return []
        step.urgent_ran = True
        stats = IterationStats(phase="prefill", batch_size=1, inside_step=True)
        return self.end_step(self._start(sched, stats, t0, pause=False))

    def _start(
        self, sched: SchedulerOutput, stats: IterationStats, t0: float, pause: bool
    ) -> EngineStep:
        stats.num_batched_tokens = sched.num_batched_tokens
        step = EngineStep(sched, stats, t0)
        try:
            step.runner = self.runner.start(sched, pause)
        except Exception as exc:  # a failed step fails its requests, never the engine loop
            step.error = exc
        return step

    def end_step(self, step: EngineStep) -> list[RequestOutput]:
        """Run what is left of ``step``, update the requests with its tokens, and return
        their outputs (and those of requests that ended before it ran)."""
        if step.done:
            raise RuntimeError("a step ended twice")
        sched, stats = step.sched, step.stats
        runner_out = None
        if step.error is None:
            assert step.runner is not None
            try:
                runner_out = step.runner.finish()
            except Exception as exc:
                step.error = exc
        step.done = True
        if runner_out is None:
            assert step.error is not None
            log.exception(
                "model step failed; failing its %d requests",
                len(sched.sequences),
                exc_info=step.error,
            )
            outputs = self._fail_step(sched, step.error, stats)
        else:
            touched = self.scheduler.update(sched, runner_out)
            if self.tier_io is not None:  # before any step can reuse a block just cached
                self.tier_io.store(self.kv_cache.take_stores())
            self.num_steps += 1
            for seq in sched.sequences:
                if seq.num_draft:
                    stats.num_drafts += 1
                    stats.num_draft_tokens += seq.num_draft
                    stats.num_accepted_tokens += len(runner_out.accepted.get(seq.request_id, ()))
            outputs = self._collect(touched, runner_out, stats)
        stats.step_seconds = self.clock() - step.t0
        self.autopilot.observe(
            zip(stats.ttft_tenants, stats.time_to_first_tokens, strict=True),
            zip(stats.itl_tenants, stats.inter_token_latencies, strict=True),
        )
        self.ledger.record(stats, self.kv_cache.tenant_blocks)
        # Each request's KV block-seconds, for its usage record (the blocks it held over
        # this step, whether it ran or waited preempted with blocks).
        for rid, num_blocks in self.kv_cache.held_counts().items():
            request = self.scheduler.requests.get(rid)
            if request is not None:
                request.kv_block_seconds += num_blocks * stats.step_seconds
        self.publish()
        for listener in self.listeners:
            listener.on_step(stats)
        if self.tier_io is not None and stats.phase == "prefill" and not step.urgent_ran:
            # What recomputing a token of prefix costs, against loading it from the tier.
            self.kv_cache.load_costs.observe_prefill(sched.num_batched_tokens, stats.step_seconds)
        if self.drafter is not None and stats.phase == "decode" and not step.urgent_ran:
            # What a decode step of this many rows costs (drafts are verified only where
            # their rows pay: ``NgramDrafter.worth``); a step an urgent prefill ran inside
            # says nothing about it.
            self.drafter.costs.observe(sched.num_batched_tokens, stats.step_seconds)
        return outputs

    def _fail_step(
        self, sched: SchedulerOutput, exc: Exception, stats: IterationStats
    ) -> list[RequestOutput]:
        ids = [s.request_id for s in sched.sequences]
        outputs, self._aborted = self._aborted, []
        for request in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR):
            request.error = f"engine step failed: {type(exc).__name__}: {exc}"
            outputs.append(self._final_output(request))
        self._record_finished(outputs, stats)
        # Blocks are registered in the prefix cache when scheduled, before their KV is written.
        # The failed step's blocks are all free now: drop every free cached prefix so no later
        # request can hit KV that was never (or half) written.
        self.kv_cache.pool.reset_prefix_cache()
        return outputs

    def _collect(
        self, touched: list[Request], runner_out: RunnerOutput, stats: IterationStats
    ) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        now = self.clock()
        for request in touched:
            state = self._outputs[request.request_id]
            self._detokenize(request, state, runner_out)
            self._record_tokens(request, now, stats, request.num_output_tokens - state.num_seen)
            state.num_seen = request.num_output_tokens
            if request.is_finished:
                outputs.append(self._final_output(request))
            elif not request.params.final_only:
                outputs.append(self._delta(request, state, finished=False))
        self._record_finished(outputs, stats)
        return outputs

    def _detokenize(self, request: Request, state: _OutputState, runner_out: RunnerOutput) -> None:
        """Feed the request's new tokens (several after an accepted draft) to its
        detokenizer one by one; a stop string ends the request at the token that completed
        it, and the tokens after it are dropped (it never produced them)."""
        rid = request.request_id
        new = request.output_token_ids[state.num_seen :]
        lps = (*runner_out.accepted_logprobs.get(rid, ()), runner_out.logprobs.get(rid))
        lps = lps[: len(new)] if len(new) <= len(lps) else (None,) * len(new)
        for i, (token, lp) in enumerate(zip(new, lps, strict=True)):
            if lp is not None:
                state.pending_logprobs.append(lp)
            try:
                state.detokenizer.append(token)
            except Exception as exc:
                log.exception("detokenizing request %s failed", rid)
                request.error = f"detokenizer failed: {type(exc).__name__}: {exc}"
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                return
            stop = state.detokenizer.matched_stop
            if stop is None:
                continue
            if not request.is_finished:
                request.truncate_output(state.num_seen + i + 1)
                request.stop_reason = stop
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                return
            if i < len(new) - 1:
                # A token stop later in the step (EOS, a stop id, max_tokens, the grammar's
                # end) ended the request already; the stop string came first, so it is what
                # plain decoding would have ended on.
                request.truncate_output(state.num_seen + i + 1)
                request.stop_reason = stop
                request.status = RequestStatus.FINISHED_STOPPED
                request.error = None
                return

    @staticmethod
    def _record_tokens(request: Request, now: float, stats: IterationStats, n: int) -> None:
        """``n`` new tokens for ``request`` arrived at ``now`` (more than one after an
        accepted draft): TTFT, or one inter-token gap for the step."""
        stats.num_generation_tokens += n
        stats.generation_tokens_by_tenant[request.tenant] += n
        if request.first_token_time is None:
            request.first_token_time = now
            stats.time_to_first_tokens.append(now - request.arrival_time)
            stats.ttft_tenants.append(request.tenant)
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.prompt_tokens_by_tenant[request.tenant] += request.num_prompt_tokens
        elif request.last_token_time is not None:
            stats.inter_token_latencies.append(now - request.last_token_time)
            stats.itl_tenants.append(request.tenant)
        request.last_token_time = now

    @staticmethod
    def _record_finished(outputs: list[RequestOutput], stats: IterationStats) -> None:
        for out in outputs:
            if out.finished and out.metrics is not None:
                stats.finished.append(
                    FinishedRequestStats(
                        request_id=out.request_id,
                        tenant=out.tenant,
                        finish_reason=out.finish_reason or "abort",
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_output_tokens=out.num_output_tokens,
                        num_cached_tokens=out.num_cached_tokens,
                        metrics=out.metrics,
                    )
                )

    def _delta(self, request: Request, state: _OutputState, *, finished: bool) -> RequestOutput:
        try:
            text = state.detokenizer.take_delta(finished=finished)
        except Exception as exc:  # this request's text is lost, never the engine loop
            log.exception("detokenizing request %s failed", request.request_id)
            request.error = f"detokenizer failed: {type(exc).__name__}: {exc}"
            text = ""
            if not finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
                self._outputs.pop(request.request_id, None)
                finished = True
        new_ids = tuple(request.output_token_ids[state.num_reported_tokens :])
        state.num_reported_tokens = request.num_output_tokens
        logprobs, state.pending_logprobs = tuple(state.pending_logprobs), []
        reason = request.status.finish_reason if finished else None
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            text=text,
            logprobs=logprobs,
            finished=finished,
            finish_reason="error" if finished and request.error else reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=request.error,
            metrics=RequestMetrics.of(request, self.clock()) if finished else None,
            tenant=request.tenant,
        )

    def _final_output(self, request: Request) -> RequestOutput:
        state = self._outputs.pop(request.request_id)
        return self._delta(request, state, finished=True)
