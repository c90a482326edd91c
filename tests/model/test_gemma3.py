"""Gemma 3 against transformers on a tiny random checkpoint whose sliding window (24 tokens)
is shorter than most prompts: the same weights as an HF directory and as a GGUF file, greedy
in fp32 one at a time, batched, with prefill chunked small and with prefix-cache hits."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.errors import UnsupportedModel
from kvgate.model.checkpoint import load_checkpoint
from kvgate.tokenizer import Tokenizer
from tests.gguf_writer import write_gguf
from tests.hf_reference import hf_greedy
from tests.tiny_model import TINY_LLAMA

WINDOW = 24
LAYERS = 6  # sliding, sliding, full, sliding, sliding, full
NEW_TOKENS = 24
PROMPT_LENS = (1, 20, 40, 100, 300)


def _layer_type(i: int) -> str:
    return "full_attention" if (i + 1) % 3 == 0 else "sliding_attention"


def _hf_config() -> Any:
    from transformers import Gemma3TextConfig

    base = {k: v for k, v in TINY_LLAMA.items() if k != "rope_theta"}
    return Gemma3TextConfig(
        **{**base, "num_hidden_layers": LAYERS},
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=[_layer_type(i) for i in range(LAYERS)],
        # Not the head dim (16): the scale must come from here.
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )


def _gemma_keys(writer: Any) -> None:
    """What llama.cpp writes for Gemma 3 beyond the common keys (and the pattern and
    attention scale, which it leaves to its defaults but which a file may state)."""
    writer.add_rope_freq_base(100000.0)
    writer.add_sliding_window(WINDOW)
    writer.add_uint32("gemma3.attention.sliding_window_pattern", 3)
    writer.add_float32("gemma3.attention.scale", 24**-0.5)  # query_pre_attn_scalar


@pytest.fixture(scope="module")
def tiny_gemma3(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer, smollm2_gguf_path: Path
) -> dict[str, Any]:
    from transformers import Gemma3ForCausalLM

    root = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(3)
    model = Gemma3ForCausalLM(_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # HF initialises (1 + w) norms to w = 0: make them matter
                p.uniform_(-0.5, 0.5)
            if "embed" in name:  # embeddings x sqrt(hidden) would drown attention's part
                p.mul_(0.05)
    model.save_pretrained(root / "hf", safe_serialization=True)
    smollm2_tokenizer.save_hf(root / "hf")
    # llama.cpp's layout of the same weights: Gemma's names, norms stored as 1 + w.
    write_gguf(root / "tiny.gguf", model, "gemma3", smollm2_gguf_path, edit=_gemma_keys)
    rng = random.Random(9)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in PROMPT_LENS]
    return {
        "hf": root / "hf",
        "gguf": root / "tiny.gguf",
        "prompts": prompts,
        "expected": hf_greedy(model, prompts, max_new_tokens=NEW_TOKENS),
        "model": model,
    }


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_matches_transformers(source: str, tiny_gemma3: dict[str, Any]) -> None:
    prompts, expected = tiny_gemma3["prompts"], tiny_gemma3["expected"]
    # max_num_batched_tokens=16: the 300-token prompt is prefilled in chunks of 16, most of
    # them wholly past the window of their sliding layers.
    llm = LLM(
        str(tiny_gemma3[source]), dtype="float32", kv_cache_memory="64MiB",
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert llm.engine.model_config.layer_types == ("sliding", "sliding", "full") * 2
    assert [_greedy(llm, [p])[0] for p in prompts] == expected  # one at a time
    assert _greedy(llm, prompts) == expected  # batched


def test_prefix_cache_hits_keep_the_window(tiny_gemma3: dict[str, Any]) -> None:
    """A prompt whose first 96 tokens are cached (4x the window) continues exactly as HF."""
    from transformers import Gemma3ForCausalLM

    prompts = tiny_gemma3["prompts"]
    longer = prompts[3] + prompts[2]  # 100 cached-able tokens, then 40 more
    expected = hf_greedy(tiny_gemma3["model"], [longer], max_new_tokens=NEW_TOKENS)
    assert isinstance(tiny_gemma3["model"], Gemma3ForCausalLM)
    llm = LLM(str(tiny_gemma3["hf"]), dtype="float32", kv_cache_memory="64MiB")
    _greedy(llm, [prompts[3]])
    out = llm.generate([longer], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    assert out.num_cached_tokens >= 96
    assert list(out.token_ids) == expected[0]


def test_the_window_is_what_makes_the_match(tiny_gemma3: dict[str, Any]) -> None:
    """The same weights with every layer global continue differently: the tests above
    would fail if the window were ignored."""
    from transformers import Gemma3ForCausalLM

    config = _hf_config()
    config.layer_types = ["full_attention"] * LAYERS
    everywhere = Gemma3ForCausalLM(config).eval()
    everywhere.load_state_dict(tiny_gemma3["model"].state_dict())
    got = hf_greedy(everywhere, tiny_gemma3["prompts"], max_new_tokens=NEW_TOKENS)
    assert sum(g != e for g, e in zip(got, tiny_gemma3["expected"], strict=True)) >= 4


def test_bfloat16_agrees(tiny_gemma3: dict[str, Any]) -> None:
    llm = LLM(str(tiny_gemma3["hf"]), dtype="bfloat16", kv_cache_memory="64MiB")
    got = _greedy(llm, tiny_gemma3["prompts"])
    first = sum(g[0] == e[0] for g, e in zip(got, tiny_gemma3["expected"], strict=True))
    assert first >= 4, (got, tiny_gemma3["expected"])


def test_gguf_norms_are_stored_plus_one(tiny_gemma3: dict[str, Any]) -> None:
    """The loader takes llama.cpp's 1 + w back to HF's w (and the weights compare equal)."""
    ckpt = load_checkpoint(tiny_gemma3["gguf"])
    state = tiny_gemma3["model"].state_dict()
    for name in ("model.layers.0.pre_feedforward_layernorm.weight", "model.norm.weight"):
        torch.testing.assert_close(ckpt.weights[name], state[name].float(), rtol=0, atol=1e-6)
    assert ckpt.config.eos_token_ids == (2,)


def test_hf_gemma3_with_soft_capped_attention_is_refused(
    tiny_gemma3: dict[str, Any], tmp_path: Path
) -> None:
    import json
    import shutil

    directory = tmp_path / "capped"
    shutil.copytree(tiny_gemma3["hf"], directory)
    config = json.loads((directory / "config.json").read_text())
    config["attn_logit_softcapping"] = 50.0
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="attn_logit_softcapping"):
        load_checkpoint(directory)


def test_a_4x_window_generation_frees_sliding_blocks_and_still_matches(
    tiny_gemma3: dict[str, Any],
) -> None:
    """Generating 4x the window: the sliding groups' blocks stay bounded while the global
    group's grow, freed blocks are never read again (the tokens match HF), and the pool is
    whole afterwards."""
    prompt = tiny_gemma3["prompts"][1]  # 20 tokens
    new = 4 * WINDOW
    expected = hf_greedy(tiny_gemma3["model"], [prompt], max_new_tokens=new)[0]
    llm = LLM(str(tiny_gemma3["hf"]), dtype="float32", kv_cache_memory="64MiB")
    engine = llm.engine
    layout = engine.kv_layout
    assert [g.window for g in layout.groups] == [None, WINDOW, WINDOW] and layout.slots == 2
    engine.add(engine.make_request("long", prompt, SamplingParams(max_tokens=new, temperature=0)))
    peaks = [0] * layout.num_groups
    while engine.has_unfinished():
        engine.step()
        for g, table in enumerate(engine.kv_cache.req_blocks.get("long", [])):
            peaks[g] = max(peaks[g], sum(1 for b in table if b is not None))
    request = engine.scheduler.requests.get("long")
    assert request is None  # ended and released
    bs = engine.config.block_size
    assert peaks[0] == -(-(len(prompt) + new - 1) // bs)
    assert max(peaks[1:]) <= -(-(WINDOW - 1 + len(prompt)) // bs) + 1
    assert engine.kv_cache.num_window_freed > 0
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks
    out = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0.0))[0]
    assert list(out.token_ids) == expected


def test_drafts_on_sliding_windows_change_no_token(tiny_gemma3: dict[str, Any]) -> None:
    """Speculative decoding over 4x the window: drafts (right, half-right, wrong) verified
    as decode rows of both sliding and global layers, blocks given back as windows move
    and drafts are rejected; the tokens are still transformers' own."""
    from tests.engine.test_speculative import use_oracle

    prompts = tiny_gemma3["prompts"][1:3]
    new = 4 * WINDOW
    expected = hf_greedy(tiny_gemma3["model"], prompts, max_new_tokens=new)
    llm = LLM(str(tiny_gemma3["hf"]), dtype="float32", kv_cache_memory="64MiB", speculative="ngram")
    drafter = use_oracle(llm.engine, {tuple(p): e for p, e in zip(prompts, expected, strict=True)})
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0))
    assert [list(o.token_ids) for o in outs] == expected
    assert 0 < drafter.num_accepted_tokens < drafter.num_draft_tokens
    assert llm.engine.kv_cache.num_window_freed > 0
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.pool.num_blocks


def test_kv_tier_restores_sliding_and_global_groups(
    tiny_gemma3: dict[str, Any], tmp_path: Path
) -> None:
    """A prefix evicted from the pool comes back from the disk tier in both groups (every
    global block, the sliding group's last window) and continues exactly as HF; so does a
    new engine on the same tier (a restart)."""
    prompts = tiny_gemma3["prompts"]
    longer = prompts[3] + prompts[2]
    expected = hf_greedy(tiny_gemma3["model"], [longer], max_new_tokens=NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    settings: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory": "64MiB", "kv_tier": "disk",
        "kv_tier_dir": str(tmp_path),
    }  # fmt: skip
    llm = LLM(str(tiny_gemma3["hf"]), **settings)
    llm.engine.kv_cache.load_costs.worth_loading = lambda block_size: True  # type: ignore[method-assign]
    _greedy(llm, [prompts[3]])
    assert llm.engine.tier_io is not None
    llm.engine.tier_io.flush()
    llm.engine.kv_cache.pool.reset_prefix_cache()
    out = llm.generate([longer], params)[0]
    assert out.num_cached_tokens >= 96
    assert list(out.token_ids) == expected[0]
    assert llm.engine.kv_cache.tier.state().counters.loads == 1
    llm.engine.close()
    again = LLM(str(tiny_gemma3["hf"]), **settings)
    again.engine.kv_cache.load_costs.worth_loading = lambda block_size: True  # type: ignore[method-assign]
    out = again.generate([longer], params)[0]
    assert out.num_cached_tokens >= 96
    assert list(out.token_ids) == expected[0]
    again.engine.close()
