"""The ``kvgate`` command: ``kvgate serve`` (the OpenAI-compatible server), ``kvgate generate``
and an interactive ``kvgate chat``."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvgate.config import DEFAULT_MODEL, GGUF_BLOCKS, EngineConfig
from kvgate.entrypoints.serve import ModelToServe, add_server_args
from kvgate.errors import KVGateError
from kvgate.model import cpu_isa
from kvgate.sampling_params import SamplingParams
from kvgate.server.config import ServerConfig, config_file_argv, config_file_models


def _engine_args(p: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    g = p.add_argument_group("engine")
    if several_models:
        g.add_argument(
            "--model",
            action="append",
            default=None,
            help="'smollm2' (default), 'gemma3-270m', 'qwen2.5-coder-1.5b', a .gguf file, or a "
            "HF checkpoint directory; repeat it to serve several models, each with its own engine",
        )
    else:
        g.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help="'smollm2' (default), 'gemma3-270m', 'qwen2.5-coder-1.5b', a .gguf file, or a "
            "HF checkpoint directory",
        )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto (default): bfloat16 where this CPU has a native bf16 linear, else float32",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8-b32"],
        help="int8 linear layers, about half of bf16's bytes per token: the weights made "
        "Q8_0 blocks at load (a scale per 32 inputs) on the W8A8 block kernels, x quantized "
        "to int8 per 32 inputs; int8-b32 is a synonym",
    )
    g.add_argument(
        "--gguf-blocks",
        default="auto",
        choices=list(GGUF_BLOCKS),
        help="a GGUF's quantized matrices: auto (default) multiplies them in their blocks "
        "natively with --dtype auto where the model is large enough to gain (>= 1 GiB in "
        "bf16), native always, dequantize never",
    )
    g.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV pool size, e.g. 2GiB, or a fraction of available memory (0.2)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--max-num-seqs", type=int, default=128, help="sequences that may run in one step"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per step (decodes and prefill chunks together): the step's budget",
    )
    g.add_argument(
        "--num-spare-seqs",
        type=int,
        default=None,
        help="sequences that may run beyond --max-num-seqs, only for requests that would "
        "otherwise preempt running work for a slot (a higher class, a tenant taking back its "
        "guarantee); default max-num-seqs/8, at least 1; 0: they preempt",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt plus output tokens (default: the model's own)",
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="never reuse the KV of a cached prefix"
    )
    g.add_argument(
        "--threads", type=int, default=None, help="the model's CPU threads (default: PyTorch's)"
    )
    g.add_argument(
        "--no-native-kernels",
        action="store_true",
        help="stay on PyTorch ops (no C kernels built at first use)",
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def _config(a: argparse.Namespace) -> EngineConfig:
    # A KVGATE_CPU_ISA above this CPU: a clear error now, naming the missing flags.
    cpu_isa.default_level()
    kv: str | float = a.kv_cache_memory
    model = a.model if isinstance(a.model, str) else (a.model or [DEFAULT_MODEL])[0]
    return EngineConfig(
        model=model,
        dtype=a.dtype,
        quantization=a.quantization,
        gguf_blocks=a.gguf_blocks,
        kv_cache_memory=kv,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        num_spare_seqs=a.num_spare_seqs,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        num_threads=a.threads,
        native_kernels=not a.no_native_kernels,
    )


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        stop=tuple(a.stop),
    )


def _load(a: argparse.Namespace) -> Any:
    from kvgate.engine.llm_engine import LLMEngine

    print(f"loading {a.model} ({a.dtype}) ...", file=sys.stderr, flush=True)
    engine = LLMEngine(_config(a))
    pool = engine.kv_pool
    print(
        f"loaded in {engine.load_seconds:.1f}s: {engine.model.num_parameters() / 1e6:.0f}M "
        f"parameters; KV pool {pool.num_blocks} blocks x {pool.block_size} tokens = "
        f"{pool.num_tokens} tokens, {pool.bytes / 2**30:.2f} GiB",
        file=sys.stderr,
        flush=True,
    )
    return engine


_ids = itertools.count()


def _stream(engine: Any, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Yield text deltas of one request as the engine produces them."""
    rid = f"cli-{next(_ids)}"
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                if out.text:
                    yield out.text
                if out.finished:
                    return


def cmd_generate(a: argparse.Namespace) -> int:
    engine = _load(a)
    params = _params(a)
    prompt: str | list[int] = a.prompt
    if not a.raw:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": a.prompt}], add_generation_prompt=True
        )
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    start = time.perf_counter()
    for delta in _stream(engine, prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(f"[{time.perf_counter() - start:.2f}s]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    engine = _load(a)
    params = _params(a)
    messages: list[dict[str, Any]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("kvgate chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        sys.stdout.write("assistant> ")
        reply = []
        for delta in _stream(engine, ids, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from kvgate.entrypoints.serve import models_to_serve, run_server, server_config

    models = models_to_serve(a, _config(a), getattr(a, "file_models", ()))
    config = server_config(a, models)
    if a.replicas is not None:
        from kvgate.cluster.app import run_cluster

        return run_cluster(a.argv, a.replicas, config)
    return run_server(models, config)


def cmd_rollout(a: argparse.Namespace) -> int:
    from kvgate.cluster.rollout_cli import cmd_rollout as run

    return run(a)


def serve_settings(argv: Sequence[str]) -> tuple[list[ModelToServe], ServerConfig]:
    """What ``kvgate serve ARGV`` would serve, and its server settings (a cluster replica
    builds its server from these)."""
    from kvgate.entrypoints.serve import models_to_serve, server_config

    a = _parse(["serve", *argv])
    models = models_to_serve(a, _config(a), getattr(a, "file_models", ()))
    return models, server_config(a, models)


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``kvgate`` parser and its ``serve`` subparser (which reads config files)."""
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_server_args(serve)
    _engine_args(serve, several_models=True)
    serve.set_defaults(func=cmd_serve)
    rollout = sub.add_parser(
        "rollout", help="canary rollouts on a running `kvgate serve --replicas` cluster"
    )
    from kvgate.cluster.rollout_cli import add_rollout_args

    add_rollout_args(rollout)
    rollout.set_defaults(func=cmd_rollout)
    gen = sub.add_parser("generate", help="generate a reply to one prompt")
    gen.add_argument("prompt", nargs="?", default="Write a haiku about a cache.")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="talk to the model in the terminal")
    chat.add_argument("--system", default=None)
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    return parser, serve


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; for ``serve --config FILE`` the file's settings come first so flags win."""
    parser, serve_parser = _build_parsers()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        given = list(sys.argv[1:] if argv is None else argv)
        file_argv = config_file_argv(args.config, serve_parser)
        flags = args
        args = parser.parse_args(["serve", *file_argv, *given[1:]])
        # Repeatable flags on the command line replace the file's, as single ones do.
        for name in ("model", "served_model_name", "kv_weight"):
            if getattr(flags, name) is not None:
                setattr(args, name, getattr(flags, name))
        args.file_models = config_file_models(args.config)
    if args.command == "serve":
        given = list(sys.argv[1:] if argv is None else argv)
        args.argv = given[1:]  # for the replicas of ``--replicas``
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parse(argv)
        return int(args.func(args))
    except KVGateError as exc:
        print(f"kvgate: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
