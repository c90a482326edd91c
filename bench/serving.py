"""Serving benchmark: ``kvgate serve`` against llama.cpp's own ``llama-server``, same weights.

Method (vLLM's ``bench serve``, from shared/brief/bench.md): streaming requests to
/v1/completions arrive Poisson at set rates, then all at once at a fixed concurrency. Each
request has a random prompt and a fixed output length (``ignore_eos``). Reported per run:
TTFT, inter-token latency (gap between streamed chunks), TPOT and end-to-end latency
p50/p90/p99, and output tokens/s over the run's wall time. Both servers are up for the whole
run (idle, a server uses no CPU) and the runs alternate between them, kvgate first, then the
peer, scenario by scenario.

Each scenario also prints its linear work (the FLOPs of every prompt and output token through
the model's projections and LM head) and, per server, the rate at which it got through it, next
to this CPU's float32 GEMM rate (PyTorch's ``F.linear`` on the model's shapes, 512 rows,
measured after the servers stop). Where float32 FMAs are the fastest arithmetic the CPU has
(AVX2 without AVX512-BF16 or AMX: bf16 and int8 weights are widened to it), that rate bounds
every server, so the share of it says how much headroom a faster kernel could still find.

The peer is llama-server built from the llama-cpp-python sdist's vendored llama.cpp
(``bench/peers/build_llama_cpp.sh``), with ``-np`` equal to the concurrency and ``-cb``, on
SmolLM2 converted to GGUF bf16 by llama.cpp's own converter from the same dequantized weights
kvgate serves. Both get the same number of threads.

    python bench/serving.py                              # rates 0.5 1 2 req/s, concurrency 32
    python bench/serving.py --rates 1 --concurrency 8 --num-requests 16 --no-peer
    python bench/serving.py --rates --kvgate bf16=--dtype=bfloat16 \
        --kvgate int8=--quantization=int8 --peer bf16 --peer q8_0 --peer q4_1
    python bench/serving.py --rates --repeats 3 --peer bf16   # medians of 3 runs in turn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import export_for_peers

from kvgate.model import cpu_isa
from kvgate.model.gguf_loader import load_gguf, load_gguf_tokenizer
from kvgate.model.registry import DEFAULT_MODEL, resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
PEER_CACHE = Path(os.environ.get("KVGATE_PEER_CACHE", Path.home() / ".cache/kvgate/peers"))


@dataclass
class Result:
    """One request's timeline, seconds from its send time."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_healthy(server: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} did not become healthy")


def start_kvgate(name: str, port: int, threads: int, max_seqs: int, *extra: str) -> Server:
    cmd = [
        sys.executable, "-m", "kvgate.entrypoints.cli", "serve",
        "--port", str(port), "--threads", str(threads), "--max-num-seqs", str(max_seqs),
        "--kv-cache-memory", "2GiB", "--max-queue-len", "4096", "--access-log", "",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    return Server(name, f"http://127.0.0.1:{port}", proc)


def start_llama_server(
    name: str, binary: str, gguf: Path, port: int, threads: int, slots: int
) -> Server:
    ctx_per_slot = 1024
    cmd = [
        binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-cb", "-c", str(slots * ctx_per_slot),
        "-t", str(threads), "-tb", str(threads), "-ngl", "0", "--log-disable",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Server(name, f"http://127.0.0.1:{port}", proc)


#: The peer's weight formats: GGUF converted by llama.cpp from the weights kvgate serves, or
#: the shipped Q4_1 file itself.
PEER_WEIGHTS = ("bf16", "q8_0", "q4_1")


def build_peer(python: str, weights: str) -> tuple[str, Path]:
    """(llama-server binary, GGUF file) for ``weights``, one of ``PEER_WEIGHTS``."""
    hf_dir = export_for_peers("bfloat16")
    script = Path(__file__).resolve().parent / "peers" / "build_llama_cpp.sh"
    print("building llama-server and converting the weights (first run: ~6 min) ...", flush=True)
    args = ["bash", str(script), python]
    if weights == "q4_1":
        gguf = resolve_model_path(DEFAULT_MODEL)  # the shipped file, as llama.cpp users run it
    else:
        gguf = PEER_CACHE / f"smollm2-{weights}.gguf"
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
        weights = load_gguf(resolve_model_path(model)).weights
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


def make_prompts(n: int, lengths: tuple[int, int], seed: int) -> list[str]:
    """Random text of about the requested token lengths (distinct, so no prefix is shared)."""
    tokenizer = load_gguf_tokenizer(resolve_model_path(DEFAULT_MODEL))
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
        choices=PEER_WEIGHTS,
        help="llama-server weights (repeatable; default bf16)",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="runs per scenario and server (medians reported)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    print(cpu_isa.describe_cpu(), flush=True)
    ours: list[Server] = []
    peers: list[Server] = []
    try:
        for i, spec in enumerate(a.kvgate or ["kvgate="]):
            name, _, args = spec.partition("=")
            ours.append(
                start_kvgate(name, 8401 + i, a.threads, max(64, a.concurrency), *args.split())
            )
        for i, weights in enumerate([] if a.no_peer else a.peer or ["bf16"]):
            binary, gguf = build_peer(sys.executable, weights)
            peers.append(
                start_llama_server(
                    f"llama.cpp-{weights}", binary, gguf, 8451 + i, a.threads, a.concurrency
                )
            )
        servers = ours + peers
        for server in servers:
            wait_healthy(server)
        for server in ours:
            print(f"{server.name}: {build_info(server.url)}", flush=True)
        warm = make_prompts(4, (16, 32), seed=a.seed + 99)
        for server in servers:  # warm-up: kernels, caches, first-request paths
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
        tokenizer = load_gguf_tokenizer(resolve_model_path(DEFAULT_MODEL))
        work = LinearWork.of_model(DEFAULT_MODEL)
        for i, (title, rate, n) in enumerate(scenarios):
            print(f"\n{title} ({n} requests)", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {server.name: [] for server in servers}
            for repeat in range(a.repeats):  # servers in turn, so noise hits each alike
                # fresh prompts per repeat: no server may answer from its prefix cache
                seed = a.seed + i + 1000 * repeat
                prompts = make_prompts(n, (a.prompt_len[0], a.prompt_len[1]), seed=seed)
                prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
                flops = work.flops(prompt_tokens, n * a.output_len, n)
                print(
                    f"  {prompt_tokens} prompt tokens; linear work {flops / 1e12:.2f} TFLOP",
                    flush=True,
                )
                for server in servers:
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
            print(
                f"  target at concurrency {a.concurrency}: >= 2x output tok/s ({ratio:.2f}x: "
                f"{'met' if ratio >= 2 else 'NOT met'}), TTFT p99 lower "
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
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
