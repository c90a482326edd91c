"""Moving KV blocks between the pool's tensors and a second tier (``disk_tier.DiskTier``),
off the engine's step.

Stores: a block is copied out of the pool on the engine thread right after the step that
filled it (a few tens of microseconds a block: SmolLM2's block of 16 tokens is 368 KiB in
bf16), while nothing can overwrite it, and written by a background thread. Loads: the
scheduler gives the blocks to the loading request alone (no step reads or writes them), so
a background thread reads the files straight into them while other requests' steps run;
the engine polls for finished loads before each step. Both threads are single: loads never
queue behind stores.

Tensor code, like the runner's: a block of group ``g`` is the block's page in every layer of
the group, along the axis of the cache tensors that counts blocks (``BlockCopier``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from kvgate.engine.block_pool import BlockHash
from kvgate.engine.disk_tier import DiskTier
from kvgate.engine.offload import BlockRef, LoadCosts, LoadOrder

log = logging.getLogger("kvgate.engine")

#: Bump when what a tier file's payload means changes (its layout of pages).
TIER_FORMAT_VERSION = 1


@dataclass(frozen=True)
class LoadDone:
    order: LoadOrder
    ok: bool
    num_blocks: int
    #: Submit to done (what the request waited), and the reading alone (what a block costs).
    seconds: float
    work_seconds: float = 0.0
    #: It ran (False: refused at once, its blocks gone from the tier since the lookup).
    started: bool = True


def tier_format(described: dict[str, Any]) -> bytes:
    """The 32-byte digest naming a KV format: whatever ``described`` holds (the weights'
    sha256, the model config, the settings that change the KV's values, the layout, dtype,
    block size and backend, kvgate's version) and ``TIER_FORMAT_VERSION``."""
    described = {**described, "tier_format": TIER_FORMAT_VERSION}
    blob = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).digest()


def model_code_digest() -> str:
    """sha256 over the source of everything that computes KV (``kvgate.model``: the models,
    attention, RoPE, the kernels' C): kvgate's version string does not move with every fix,
    and a tier must never serve KV that code before a fix computed."""
    h = hashlib.sha256()
    root = resources.files("kvgate.model")
    stack = [root]
    files = []
    while stack:
        for entry in stack.pop().iterdir():
            if entry.is_dir():
                stack.append(entry)
            elif entry.name.endswith((".py", ".c", ".h")):
                files.append(entry)
    for entry in sorted(files, key=lambda e: str(e)):
        h.update(entry.name.encode())
        h.update(entry.read_bytes())
    return h.hexdigest()


def block_axis(shape: Callable[[int], tuple[int, ...]]) -> int:
    """The axis of a cache shape (``shape(num_blocks)``) that counts blocks."""
    one, two = shape(1), shape(2)
    axes = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(axes) != 1:
        raise ValueError(f"no single block axis in the cache shape {one}")
    return axes[0]


class BlockCopier:
    """One block's bytes of a group: its page in each of the group's layers, K then V, in
    layer order."""

    def __init__(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        layer_groups: Sequence[int],
        axis: int,
    ) -> None:
        """``layer_groups``: each layer's group; ``axis``: the block axis of the tensors."""
        self.axis = axis
        num_groups = max(layer_groups) + 1
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        for (k, v), g in zip(kv_caches, layer_groups, strict=True):
            self.parts[g] += [t for t in (k, v) if t.numel()]
        self._nbytes = [
            sum(t.select(axis, 0).numel() * t.element_size() for t in ts) for ts in self.parts
        ]

    def nbytes(self, group: int) -> int:
        return self._nbytes[group]

    def read(self, group: int, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks' bytes, ``[len(block_ids), nbytes(group)]`` uint8: two ops a
        layer whatever the number of blocks (a gather, then into place)."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        out = torch.empty((len(block_ids), self._nbytes[group]), dtype=torch.uint8)
        at = 0
        for t in self.parts[group]:
            pages = t.index_select(self.axis, ids).movedim(self.axis, 0)  # [N, page...]
            n = pages[0].numel() * t.element_size()
            out[:, at : at + n].view(t.dtype).view(pages.shape).copy_(pages)
            at += n
        return out

    def write(self, group: int, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Put ``payload`` (``[len(block_ids), nbytes(group)]`` uint8) into the blocks."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        at = 0
        for t in self.parts[group]:
            page = t.select(self.axis, 0)
            n = page.numel() * t.element_size()
            pages = payload[:, at : at + n].view(t.dtype).view(len(block_ids), *page.shape)
            t.index_copy_(self.axis, ids, pages.movedim(0, self.axis))
            at += n


class TierIO:
    """Loads and stores of one engine, on two background threads."""

    def __init__(
        self,
        tier: DiskTier,
        copier: BlockCopier,
        costs: LoadCosts | None = None,
        *,
        max_pending_bytes: int = 256 << 20,
        load_executor: Executor | None = None,
    ) -> None:
        """``max_pending_bytes``: block copies waiting to be written, at most; beyond, new
        stores are dropped (counted) rather than letting memory grow. ``load_executor``:
        where loads run (tests pass one they can hold)."""
        self.tier = tier
        self.copier = copier
        self.costs = costs or LoadCosts()
        self.max_pending_bytes = max_pending_bytes
        self._loads = load_executor or ThreadPoolExecutor(1, thread_name_prefix="kvgate-kv-load")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="kvgate-kv-store")
        self._done: queue.SimpleQueue[LoadDone] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._store_futures: set[Future[None]] = set()
        self._write_failed_until = 0.0
        self.num_loading = 0

    # ------------------------------------------------------------------ loads
    def load(self, order: LoadOrder) -> None:
        """Start loading ``order``'s blocks into the pool; ``poll`` reports it done (also
        when it could not start: its blocks must come back)."""
        keys = [ref.key for ref in order.blocks]
        t0 = time.monotonic()
        if not self.tier.prepare_load(keys):  # evicted since the lookup
            self._done.put(LoadDone(order, False, len(keys), 0.0, started=False))
            return
        try:
            self._loads.submit(self._load, order, keys, t0)
        except Exception:  # shut down: nothing will write the blocks
            log.exception("KV tier: a load could not start")
            self.tier.complete_load(keys)
            self._done.put(LoadDone(order, False, len(keys), 0.0, started=False))
            return
        self.num_loading += 1

    def _load(self, order: LoadOrder, keys: list[BlockHash], t0: float) -> None:
        ok = True
        start = time.monotonic()
        try:
            by_group: dict[int, list[BlockRef]] = {}
            for ref in order.blocks:
                by_group.setdefault(ref.group, []).append(ref)
            for group, refs in by_group.items():
                staging = torch.empty((len(refs), self.copier.nbytes(group)), dtype=torch.uint8)
                rows = staging.numpy()
                if not all(self.tier.read_into(r.key, rows[i].data) for i, r in enumerate(refs)):
                    ok = False
                    break
                self.copier.write(group, [r.block_id for r in refs], staging)
            if ok:
                self.tier.touch([ref.key for ref in order.blocks])
        except Exception:
            log.exception("KV tier: loading blocks for %s failed", order.request_id)
            ok = False
        finally:
            self.tier.complete_load(keys)
            end = time.monotonic()
            self._done.put(LoadDone(order, ok, len(keys), end - t0, end - start))

    def poll(self, wait: float = 0.0) -> list[LoadDone]:
        """Loads finished since the last poll (engine thread), waiting up to ``wait`` seconds
        for the first; their costs recorded."""
        out: list[LoadDone] = []
        while True:
            try:
                done = self._done.get(timeout=wait) if wait and not out else self._done.get_nowait()
            except queue.Empty:
                break
            out.append(done)
        for d in out:
            self.num_loading -= d.started
            if d.ok:
                self.tier.count(loads=1, loaded_blocks=d.num_blocks, load_seconds=d.seconds)
                self.costs.observe_load(d.num_blocks, d.work_seconds)
            else:
                self.tier.count(failed_loads=1)
        return out

    # ------------------------------------------------------------------ stores
    #: After a failed write (a full or read-only disk), seconds during which new stores are
    #: dropped (counted) rather than copied and failing again, block after block.
    WRITE_BACKOFF_S = 30.0

    def store(self, refs: Sequence[BlockRef]) -> int:
        """Copy ``refs``' blocks now (engine thread, before any can be reused) and write them
        in the background; those the tier holds or has on their way are skipped. Returns
        how many were taken."""
        if not refs:
            return 0
        if time.monotonic() < self._write_failed_until:
            self.tier.count(dropped_stores=len(refs))
            return 0
        taken = 0
        by_group: dict[int, list[BlockRef]] = {}
        for ref in refs:
            by_group.setdefault(ref.group, []).append(ref)
        for group, group_refs in by_group.items():
            nbytes = self.copier.nbytes(group)
            keys = set(self.tier.prepare_store([r.key for r in group_refs], nbytes))
            fresh = [r for r in group_refs if r.key in keys]
            with self._lock:
                room = (self.max_pending_bytes - self._pending_bytes) // max(nbytes, 1)
            late = fresh[max(room, 0) :]
            fresh = fresh[: max(room, 0)]
            if late:
                self.tier.complete_store([r.key for r in late], ok=False)
                self.tier.count(dropped_stores=len(late))
            if not fresh:
                continue
            try:
                rows = self.copier.read(group, [r.block_id for r in fresh]).numpy()
            except Exception:
                self.tier.complete_store([r.key for r in fresh], ok=False)
                raise
            copies = [(r.key, rows[i].data) for i, r in enumerate(fresh)]
            with self._lock:
                self._pending_bytes += nbytes * len(copies)
            future = self._stores.submit(self._write, copies, nbytes)
            with self._lock:
                self._store_futures.add(future)
            future.add_done_callback(self._forget_future)
            taken += len(copies)
        return taken

    def _write(self, copies: list[tuple[BlockHash, memoryview]], nbytes: int) -> None:
        for key, payload in copies:
            ok = False
            try:
                ok = time.monotonic() >= self._write_failed_until and self.tier.write(key, payload)
            except Exception:
                log.exception("KV tier: writing a block failed")
            finally:
                self.tier.complete_store([key], ok)
                self.tier.count(**{"stored_blocks" if ok else "dropped_stores": 1})
                with self._lock:
                    self._pending_bytes -= nbytes
            if not ok and time.monotonic() >= self._write_failed_until:
                self._write_failed_until = time.monotonic() + self.WRITE_BACKOFF_S
                log.warning(
                    "KV tier: a write failed; dropping new stores for %.0f s",
                    self.WRITE_BACKOFF_S,
                )

    def _forget_future(self, future: Future[None]) -> None:
        with self._lock:
            self._store_futures.discard(future)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every store submitted so far to be written."""
        with self._lock:
            futures = list(self._store_futures)
        for f in futures:
            f.result(timeout)

    def close(self) -> None:
        """Write what is pending (a clean shutdown keeps every block), then stop."""
        self.flush()
        self._stores.shutdown(wait=True)
        self._loads.shutdown(wait=True)
        self.tier.close()
