"""DeepSeek-V4 against transformers on tiny random checkpoints: a sliding window plus
compressed KV (heavily compressed and sparse with its indexer) in the paged pool,
hyper-connections, hash-routed and top-k experts, grouped output projection. Greedy in fp32,
one prompt at a time, batched, prefilled in small chunks and continued from prefix-cache hits,
for prompts shorter and longer than the window and every compression block."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate import SamplingParams
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.entrypoints.llm import LLM
from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.deepseek_v4 import DeepseekV4Model
from kvgate.model.kv_spec import KVSpec
from kvgate.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy

VOCAB = 49152  # SmolLM2's tokenizer
NEW_TOKENS = 10
PROMPT_LENS = (1, 5, 20, 70, 150)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_rates": {CSA: 4, HCA: 16},
    "layer_types": [HCA, CSA, "sliding_attention", CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    # Sixteen indexer heads: with four, an entry all of whose heads' ReLUs are zero (score
    # exactly 0) often ties another at the top-k edge, and transformers breaks such ties by
    # torch.topk's order, which changes with the row's length (kvgate: the earlier entry).
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,  # fewer than the entries of the longer prompts: the choice matters
    "hc_mult": 2,
    "hc_sinkhorn_iters": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.15,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}


def _build(directory: Path, tokenizer: Tokenizer) -> Any:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(5)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**CONFIG))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # what transformers starts at zero, made to matter
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):  # each token id's own two experts
                rows = [torch.randperm(8, generator=g)[:2] for _ in range(VOCAB)]
                gate.tid2eid.copy_(torch.stack(rows))
            else:
                gate.e_score_correction_bias.normal_(0, 0.1, generator=g)
            for module in layer.modules():
                if hasattr(module, "position_bias"):
                    module.position_bias.normal_(0, 0.5, generator=g)
            layer.self_attn.sinks.normal_(0, 1, generator=g)
    model.eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("deepseek-v4")
    model = _build(root, smollm2_tokenizer)
    rng = random.Random(9)
    prompts = [[rng.randrange(100, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    return {
        "dir": root,
        "model": model,
        "prompts": prompts,
        "expected": hf_greedy(model, prompts, max_new_tokens=NEW_TOKENS),
    }


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("chunk", [512, 16, 7])
def test_greedy_matches_transformers(chunk: int, tiny: dict[str, Any]) -> None:
    """Whole prompts, and prompts prefilled in chunks of 16 and 7 tokens (chunks that end
    inside windows and compression blocks): every entry is computed from the pool."""
    prompts, expected = tiny["prompts"], tiny["expected"]
    llm = LLM(
        str(tiny["dir"]), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=chunk
    )
    assert llm.engine.build_info["kv_backend"] == "torch-compressed"
    assert [_greedy(llm, [p])[0] for p in prompts] == expected  # one at a time
    assert _greedy(llm, prompts) == expected  # batched


def test_prefix_cache_hits_read_the_window_and_the_entries(tiny: dict[str, Any]) -> None:
    """A prompt continued from a cached prefix reads the cached window (the compressors'
    projections too) and the cached entries, and computes the rest as one prefilled whole
    would: the hit is whole blocks of both groups."""
    prompts = tiny["prompts"]
    longer = prompts[4] + prompts[3]  # 150 cached-to-be tokens, then 70 more
    expected = hf_greedy(tiny["model"], [longer], max_new_tokens=NEW_TOKENS)
    llm = LLM(str(tiny["dir"]), dtype="float32", kv_cache_memory="64MiB", block_size=4)
    layout = llm.engine.kv_layout
    assert [g.entries for g in layout.groups] == [False, True]
    unit = layout.reuse_span * 4
    _greedy(llm, [prompts[4]])
    out = llm.generate([longer], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    assert out.num_cached_tokens == 150 // unit * unit > 0
    assert list(out.token_ids) == expected[0]


def test_the_pool_holds_the_window_and_one_entry_per_rate_tokens(tiny: dict[str, Any]) -> None:
    """KV bytes a sequence holds, from the pool's own accounting: every layer's window (its
    blocks out of it go back to the pool) and the entries, against 2 x heads x head dim a
    token a layer for plain attention of the same width."""
    llm = LLM(str(tiny["dir"]), dtype="float32", kv_cache_memory="64MiB")
    engine = llm.engine
    layout, kv = engine.kv_layout, engine.kv_cache
    assert layout.specs[2] == KVSpec.compressed(8, 32, None, 0, dtype="float32")
    assert layout.specs[1].rate == 4 and layout.specs[0].rate == 16
    rng = random.Random(3)
    prompt = [rng.randrange(100, VOCAB) for _ in range(1500)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    held: list[tuple[int, int, int]] = []  # (window blocks, entry blocks, tokens) a step
    while engine.has_unfinished():
        engine.step()
        for r in engine.scheduler.running:
            kv.check_windows([r])
            window, entries = kv.req_blocks[r.request_id]
            count = [sum(b is not None for b in t) for t in (window, entries)]
            held.append((count[0], count[1], r.num_computed_tokens))
            # What /metrics reports: the same accounting, from the engine's snapshot.
            snap = EngineSnapshot.capture(engine)
            blocks = count[0] + count[1]
            want = blocks * layout.block_bytes(16) / r.num_computed_tokens
            assert snap.kv_held_bytes_per_token == pytest.approx(want)
    span = layout.groups[1].span * 16  # tokens an entry block covers
    for window, entries, tokens in held:
        assert entries == -(-tokens // span)
        if tokens > 1500:  # decoding: the window's 16 positions, in one block or two
            assert window <= 2
    window, entries, tokens = held[-1]
    per_token = (window + entries) * layout.block_bytes(16) / tokens
    plain = 4 * 2 * 4 * 32 * 4  # layers x (K, V) x heads x head dim x float32
    assert plain / per_token > 16, per_token


def test_the_indexer_choice_matters(tiny: dict[str, Any]) -> None:
    """The same weights attending to every ready entry (no top-k) continue differently: the
    match above would fail if the indexer's choice were ignored."""
    model = tiny["model"]
    saved = model.config.index_topk
    for layer in model.model.layers:
        if layer.self_attn.compressor is not None and hasattr(
            layer.self_attn.compressor, "indexer"
        ):
            layer.self_attn.compressor.indexer.index_topk = 10_000
    try:
        got = hf_greedy(model, tiny["prompts"], max_new_tokens=NEW_TOKENS)
    finally:
        for layer in model.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                comp.indexer.index_topk = saved
    assert got != tiny["expected"]


def test_bfloat16_agrees(tiny: dict[str, Any]) -> None:
    llm = LLM(str(tiny["dir"]), dtype="bfloat16", kv_cache_memory="64MiB")
    assert isinstance(llm.engine.model, DeepseekV4Model)
    got = _greedy(llm, tiny["prompts"])
    first = sum(g[0] == e[0] for g, e in zip(got, tiny["expected"], strict=True))
    assert first >= 3, (got, tiny["expected"])


def test_deepseeks_own_names_load_and_the_mtp_layer_is_dropped(
    tiny: dict[str, Any], tmp_path: Path
) -> None:
    """DeepSeek's checkpoints name tensors without ``model.`` (``embed``, ``head``,
    ``hc_head_fn``, ``layers.N.attn.wq_a``) and carry a multi-token-prediction layer
    (``mtp.*``): the same model, the same tokens."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "native"
    shutil.copytree(tiny["dir"], directory)
    weights = load_file(str(directory / "model.safetensors"))
    native = {}
    for name, tensor in weights.items():
        bare = name.removeprefix("model.")
        bare = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn"}.get(
            bare, bare
        )
        bare = {"hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(
            bare, bare
        )
        native[bare] = tensor
    native["mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4)
    assert "embed.weight" in native and "layers.0.attn.wq_a.weight" in native
    (directory / "model.safetensors").unlink()
    save_file(native, str(directory / "model.safetensors"))
    llm = LLM(str(directory), dtype="float32", kv_cache_memory="64MiB")
    assert _greedy(llm, tiny["prompts"][:3]) == tiny["expected"][:3]


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("scoring_func", "softmax", "scoring_func"),
        ("num_key_value_heads", 2, "KV head"),
        ("layer_types", ["sliding_attention"] * 3, "layer_types"),
        ("o_groups", 3, "o_groups"),
        ("quantization_config", {"quant_method": "fp8"}, "quantized"),
    ],
)
def test_what_it_cannot_run_is_refused_naming_it(
    key: str, value: Any, words: str, tiny: dict[str, Any], tmp_path: Path
) -> None:
    directory = tmp_path / key
    shutil.copytree(tiny["dir"], directory)
    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())
    raw[key] = value
    config_file.write_text(json.dumps(raw))
    with pytest.raises((UnsupportedModel, CorruptWeights), match=words):
        load_checkpoint(directory)


def test_the_config_reads_legacy_spellings_and_transformers_defaults() -> None:
    """Older configs: ``rope_scaling`` (YaRN on the compressed layers only, its cos/sin
    factor 1), ``compress_ratios`` per layer, ``num_hash_layers``; missing sizes take
    transformers' defaults (V4-Flash's)."""
    from kvgate.model.deepseek_v4 import V4Fields, deepseek_v4_hf_fields

    raw = {
        "num_hidden_layers": 3,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64},
        "compress_ratios": [128, 4, 0],
        "num_hash_layers": 1,
        "max_position_embeddings": 4096,
        "num_attention_heads": 64,
    }
    out = deepseek_v4_hf_fields(raw, "config.json")
    f = out["arch_fields"]
    assert isinstance(f, V4Fields)
    assert f.layer_types == (HCA, CSA, "sliding_attention")
    assert f.hashed == (True, False, False)
    assert f.compress_scaling is not None and f.compress_scaling.kind == "yarn"
    assert f.compress_scaling.factor == 16 and f.compress_scaling.cos_sin_scale() == 1.0
    assert out["rope"] == (10000.0, None) and f.compress_theta == 160000.0
    assert (out["head_dim"], f.rope_dim, f.sliding_window, f.hc_mult) == (512, 64, 128, 4)
    assert (f.index_topk, f.num_experts, f.experts_per_token) == (512, 256, 6)


def test_quantized_kv_is_refused_naming_why(tiny: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedModel, match="torch-compressed: it stores pages as"):
        LLM(str(tiny["dir"]), dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype="int8")


def test_a_pool_too_small_for_the_batch_preempts_and_stays_exact(tiny: dict[str, Any]) -> None:
    """Twelve blocks for five prompts that need four each: sequences are preempted, their
    window and entry blocks freed, and recomputed (from what the prefix cache kept) to the
    same tokens."""
    probe = LLM(str(tiny["dir"]), dtype="float32", kv_cache_memory="64MiB")
    block = probe.engine.kv_layout.block_bytes(16)
    llm = LLM(
        str(tiny["dir"]),
        dtype="float32",
        kv_cache_memory=str(12 * block),
        max_model_len=256,
        max_num_batched_tokens=16,
    )
    assert llm.engine.kv_pool.num_blocks == 12
    assert _greedy(llm, tiny["prompts"]) == tiny["expected"]
    assert llm.engine.scheduler.num_preemptions > 0
