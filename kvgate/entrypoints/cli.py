"""The ``kvgate`` command: ``kvgate serve`` (the OpenAI-compatible server), ``kvgate generate``,
an interactive ``kvgate chat``, and ``kvgate plan`` (memory sizing, no model loaded)."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvgate.config import KV_CACHE_DTYPES
from kvgate.errors import KVGateError
from kvgate.launch.settings import (
    add_engine_args,
    add_serve_args,
    engine_config,
    launch_of,
    parse_serve,
)
from kvgate.sampling_params import SamplingParams


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


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
    engine = LLMEngine(engine_config(a))
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
    from kvgate.launch.server import run_server

    launch = launch_of(a)
    if a.replicas is not None:
        from kvgate.cluster.app import run_cluster

        return run_cluster(launch, a.replicas)
    return run_server(launch)


def cmd_plan(a: argparse.Namespace) -> int:
    """Print the plan; 0 when the pool holds ``--concurrency`` sequences (one, without) for
    some KV dtype shown, else 1."""
    from kvgate.launch.plan import DEFAULT_MARGIN, plan_for, render

    dtypes = KV_CACHE_DTYPES if a.kv_cache_dtype == "all" else (a.kv_cache_dtype,)
    a.kv_cache_dtype = dtypes[0]
    plan = plan_for(
        engine_config(a),
        memory=a.memory,
        margin=DEFAULT_MARGIN if a.margin is None else a.margin,
        concurrency=a.concurrency,
        kv_dtypes=dtypes,
    )
    print(render(plan))
    return 0 if any(kv.sequences >= (a.concurrency or 1) for kv in plan.kv) else 1


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """``kvgate plan``'s flags: the engine's (``--kv-cache-dtype`` takes ``all`` too), and
    the budget's. ``p`` must resolve conflicting flags (``conflict_handler="resolve"``)."""
    add_engine_args(p)
    g = p.add_argument_group("plan")
    g.add_argument(
        "--memory",
        default=None,
        help="the server's whole memory, e.g. 16GiB or a fraction of available memory (0.8): "
        "the KV pool gets what the weights, runtime and margin leave, and the plan gives its "
        "--kv-cache-memory; default: the pool is --kv-cache-memory, and the plan gives the "
        "memory it needs",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="sequences of --max-model-len that must fit at once: whether they do, and the "
        "memory and --kv-cache-memory they need",
    )
    g.add_argument(
        "--margin", type=float, default=None, help="the share of the memory kept free (0.1)"
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="all",
        choices=[*KV_CACHE_DTYPES, "all"],
        help="the KV dtype to plan; all (default): a row for each",
    )


def cmd_rollout(a: argparse.Namespace) -> int:
    from kvgate.cluster.rollout_cli import cmd_rollout as run

    return run(a)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvgate`` parser: ``serve`` (its flags are ``kvgate.launch.settings``'s),
    ``rollout``, ``plan``, ``generate`` and ``chat``."""
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    rollout = sub.add_parser(
        "rollout", help="canary rollouts on a running `kvgate serve --replicas` cluster"
    )
    from kvgate.cluster.rollout_cli import add_rollout_args

    add_rollout_args(rollout)
    rollout.set_defaults(func=cmd_rollout)
    plan = sub.add_parser(
        "plan",
        help="how many sequences of --max-model-len fit in --memory, per KV dtype (reads the "
        "model's headers only)",
        conflict_handler="resolve",
    )
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    gen = sub.add_parser("generate", help="generate a reply to one prompt")
    gen.add_argument("prompt", nargs="?", default="Write a haiku about a cache.")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="talk to the model in the terminal")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line parsed; ``serve``'s arguments as ``kvgate.launch`` reads them
    (``--config FILE`` first, flags over it), its raw arguments kept as ``argv``."""
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(given)
    if args.command == "serve":
        func = args.func
        args = parse_serve(given[1:])
        args.command, args.func = "serve", func
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
        return int(args.func(args))
    except KVGateError as exc:
        print(f"kvgate: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
