"""LoRA adapters through the engine (``engine/lora_cache.py``, the runner's ``LoraRows``):
greedy tokens of requests on adapters against transformers + peft (fp32) on the tiny Llama,
alone and in one batch with other adapters and the base; the prefix cache kept apart per
adapter; the LRU under a memory cap; what is refused."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.lora_cache import LoraCache, LoraExists, LoraMemoryFull, LoraNotFound
from kvgate.errors import InvalidConfig
from kvgate.launch.settings import lora_modules
from kvgate.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config
from tests.hf_reference import hf_greedy
from tests.lora_adapters import make_adapter
from tests.tiny_model import TINY_LLAMA

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def setup(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Llama in transformers, three adapters of it (``a``, ``b`` on q and v only,
    ``c``), and an engine started with ``a`` and ``b`` (``lora_modules``)."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora-engine")
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    peft = {
        "a": make_adapter(hf, root / "a", seed=21),
        "b": make_adapter(
            hf, root / "b", seed=22, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "c": make_adapter(hf, root / "c", seed=23, r=16, lora_alpha=16),
    }
    engine = LLMEngine(
        tiny_engine_config(
            tiny_llama_dir,
            max_num_batched_tokens=64,
            lora_modules=(("a", str(root / "a")), ("b", str(root / "b"))),
        )
    )
    return {"root": root, "hf": hf, "peft": peft, "engine": engine, "refs": {}}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49152) for _ in range(n)]


def _reference(setup: dict[str, Any], adapter: str | None, prompt: list[int]) -> list[int]:
    key = (adapter, tuple(prompt))
    if key not in setup["refs"]:
        model = setup["hf"] if adapter is None else setup["peft"][adapter]
        setup["refs"][key] = hf_greedy(model, [prompt], NEW_TOKENS)[0]
    return list(setup["refs"][key])


def _run(engine: LLMEngine, jobs: list[tuple[str | None, list[int]]]) -> list[Any]:
    """Add every job (adapter name, prompt) at once, step until all end: their requests
    and their token ids."""
    requests = [
        engine.add_request(
            f"r{i}-{random.random()}",
            prompt,
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, lora_name=name),
        )
        for i, (name, prompt) in enumerate(jobs)
    ]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return [(r, tokens[r.request_id]) for r in requests]


def _assert_blocks_back(engine: LLMEngine) -> None:
    engine.kv_cache.pool.check_invariants()
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert not engine.kv_cache.req_blocks


def test_one_adapter_matches_peft(setup: dict[str, Any]) -> None:
    engine, prompt = setup["engine"], _prompt(1, 21)
    [(_, got)] = _run(engine, [("a", prompt)])
    assert got == _reference(setup, "a", prompt)
    assert got != _reference(setup, None, prompt)  # the adapter changes the output
    _assert_blocks_back(engine)


def test_a_batch_of_two_adapters_and_the_base(setup: dict[str, Any]) -> None:
    engine = setup["engine"]
    jobs: list[tuple[str | None, list[int]]] = [
        ("a", _prompt(2, 19)),
        (None, _prompt(3, 37)),
        ("b", _prompt(4, 9)),
        ("a", _prompt(5, 50)),  # two prefill chunks beside the others' decodes
        ("b", _prompt(6, 24)),
    ]
    results = _run(engine, jobs)
    for (name, prompt), (_, got) in zip(jobs, results, strict=True):
        assert got == _reference(setup, name, prompt), name
    _assert_blocks_back(engine)


def test_the_prefix_cache_is_kept_apart_per_adapter(setup: dict[str, Any]) -> None:
    engine, prompt = setup["engine"], _prompt(7, 53)  # 3 full blocks of 16
    outs = {}
    for name in ("a", "b", None, "a"):
        [(request, got)] = _run(engine, [(name, prompt)])
        assert got == _reference(setup, name, prompt), name
        outs.setdefault(name, []).append((request.num_cached_tokens, got))
    # The first of each computed everything: nothing cached under another adapter served it.
    assert outs["a"][0][0] == 0 and outs["b"][0][0] == 0 and outs[None][0][0] == 0
    assert outs["a"][1][0] == 48  # the same adapter again: a hit
    assert len({tuple(outs[n][0][1]) for n in ("a", "b", None)}) == 3
    _assert_blocks_back(engine)


def test_lru_eviction_under_the_memory_cap(setup: dict[str, Any], tiny_llama_dir: Path) -> None:
    root = setup["root"]
    engine = LLMEngine(tiny_engine_config(tiny_llama_dir, max_num_batched_tokens=64))
    cache = engine.loras
    for name in ("a", "b", "c"):
        cache.register(name, root / name)
    sizes = {name: cache.resident[name].nbytes for name in cache.resident}
    # Re-start the cache under a cap that fits the two largest adapters, not all three.
    cap = sizes.get("a", 0) + sizes["c"] + 1
    for name in list(cache.resident):
        del cache.resident[name]
    cache.max_bytes = cap
    prompt = _prompt(8, 18)
    loads = cache.num_loads
    for name in ("a", "c", "b"):  # b's arrival evicts a, the least recently used
        [(_, got)] = _run(engine, [(name, prompt)])
        assert got == _reference(setup, name, prompt), name
    assert list(cache.resident) == ["c", "b"] and cache.resident_bytes <= cap
    [(_, got)] = _run(engine, [("a", prompt)])  # reloaded (evicting c), still right
    assert got == _reference(setup, "a", prompt)
    assert list(cache.resident) == ["b", "a"]
    assert cache.num_loads == loads + 4
    _assert_blocks_back(engine)


def test_an_adapter_in_use_is_never_evicted(setup: dict[str, Any], tiny_llama_dir: Path) -> None:
    root = setup["root"]
    engine = LLMEngine(tiny_engine_config(tiny_llama_dir))
    cache = engine.loras
    cache.register("c", root / "c")
    cache.max_bytes = cache.resident_bytes + 1  # room for c alone
    params = SamplingParams(max_tokens=4, temperature=0.0, lora_name="c")
    engine.add_request("holds-c", _prompt(9, 10), params)
    with pytest.raises(LoraMemoryFull, match="--max-lora-memory"):
        cache.register("a", root / "a")
    assert "a" not in cache.paths and list(cache.resident) == ["c"]
    while engine.has_unfinished():
        engine.step()
    cache.register("a", root / "a")  # c is free now: evicted for a
    assert list(cache.resident) == ["a"]


def test_what_is_refused(setup: dict[str, Any], tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    engine, root = setup["engine"], setup["root"]
    with pytest.raises(LoraNotFound, match="'nope'"):
        engine.add_request("x1", [5, 6, 7], SamplingParams(lora_name="nope"))
    with pytest.raises(LoraExists):
        engine.loras.register("a", root / "c")
    with pytest.raises(InvalidConfig, match="not a directory"):
        engine.loras.register("z", tmp_path / "missing")
    # An adapter of another base model: refused at start, naming the tensor and shapes.
    other = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "intermediate_size": 96})).eval()
    make_adapter(other, tmp_path / "other", seed=1)
    with pytest.raises(
        InvalidConfig, match=r"down_proj.lora_A.weight. has shape \[8, 96\], expected \[8, 160\]"
    ):
        LLMEngine(
            tiny_engine_config(tiny_llama_dir, lora_modules=(("o", str(tmp_path / "other")),))
        )
    # An adapter whose files went away since it was registered: its next load fails clearly.
    shutil.copytree(root / "b", tmp_path / "gone")
    engine.loras.register("gone", tmp_path / "gone")
    engine.loras.resident.pop("gone")
    (tmp_path / "gone" / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidConfig, match=r"no adapter_model\.safetensors"):
        engine.add_request("x2", [5, 6, 7], SamplingParams(lora_name="gone"))
    engine.loras.unregister("gone")
    assert not engine.has_unfinished()
    _assert_blocks_back(engine)


def test_a_model_class_without_lora_refuses_adapters(setup: dict[str, Any]) -> None:
    engine = setup["engine"]
    cache = LoraCache(engine.model_config, 1 << 30, set, supported=False, model_name="Gemma3n")
    with pytest.raises(InvalidConfig, match=r"Gemma3n .* does not support LoRA"):
        cache.register("a", setup["root"] / "a")


def test_lora_modules_flag() -> None:
    assert lora_modules(["x=/p/x", "y=/p/y=2"]) == (("x", "/p/x"), ("y", "/p/y=2"))
    assert lora_modules(None) == ()
    with pytest.raises(InvalidConfig, match="NAME=PATH, got '/p/x'"):
        lora_modules(["/p/x"])
    with pytest.raises(InvalidConfig, match="distinct"):
        tiny_engine_config(Path("."), lora_modules=(("x", "/a"), ("x", "/b")))


def test_speculative_drafts_take_the_adapter_on_every_row(
    setup: dict[str, Any], tiny_llama_dir: Path
) -> None:
    root = setup["root"]
    engine = LLMEngine(
        tiny_engine_config(
            tiny_llama_dir, speculative="ngram", lora_modules=(("a", str(root / "a")),)
        )
    )
    prompt = _prompt(10, 6)
    refs = {"a": _reference(setup, "a", prompt), None: _reference(setup, None, prompt)}
    drafter = engine.drafter
    assert drafter is not None

    def propose(request: Any, room: int) -> list[int]:
        """Drafts of the true continuation (the adapter's, or the base's), the last wrong:
        accepted only where the draft rows ran with the request's adapter."""
        ref = refs[request.params.lora_name]
        draft = ref[request.num_output_tokens : request.num_output_tokens + 3][:room]
        return [*draft[:-1], (draft[-1] + 1) % 49152] if draft else []

    drafter.propose = propose  # type: ignore[method-assign]
    drafter.worth = lambda _rid, n, _rows, _tokens: n  # type: ignore[method-assign]
    build, seen = engine.runner.build_batch, []

    def recording(sequences: Any) -> Any:
        batch = build(sequences)
        seen.append(bool(batch.drafts) and batch.lora is not None)
        return batch

    engine.runner.build_batch = recording  # type: ignore[method-assign]
    for name in ("a", None):
        engine.add_request(
            str(name), prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                              lora_name=name)
        )  # fmt: skip
    tokens: dict[str, list[int]] = {"a": [], "None": []}
    most = 0  # most tokens one step gave a request: >1 where drafts were accepted
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            most = max(most, len(out.new_token_ids))
    assert any(seen) and most > 1  # drafts verified with the adapter's rows, and accepted
    assert tokens["a"] == refs["a"]
    assert tokens["None"] == refs[None]
    _assert_blocks_back(engine)
