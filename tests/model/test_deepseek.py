"""DeepSeek-V2 and V3 against transformers on tiny random checkpoints: latent attention over
the paged latent cache (absorbed projections), YaRN RoPE, experts with shared experts and
group-limited routing after dense first layers. Greedy in fp32, one prompt at a time, batched,
with prefill chunked small and with prefix-cache hits."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.deepseek import DeepseekFields, DeepseekModel
from kvgate.model.kv_spec import KVSpec
from kvgate.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy

VOCAB = 49152  # SmolLM2's tokenizer
NEW_TOKENS = 12
PROMPT_LENS = (1, 20, 70, 300)
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,  # three: the order of their sum shows in fp32
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
    "n_group": 4,
    "topk_group": 2,
    # Weights large enough that attention is sharp: with the default (0.02) every query
    # attends almost evenly, and RoPE, the softmax scale or the pair layout would not show.
    "initializer_range": 0.15,
}
# original_max_position_embeddings=128: prompt positions fall in YaRN's ramp and past it.
_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
VARIANTS: dict[str, dict[str, Any]] = {
    # V3 as shipped: q through its low-rank bottleneck, YaRN, sigmoid routing with a bias.
    "v3": {"kind": "v3", "q_lora_rank": 48, "n_shared_experts": 1, "rope_parameters": _YARN},
    # V3 with its rotary dims as halves, not pairs, and no bottleneck or YaRN.
    "v3-halves": {"kind": "v3", "q_lora_rank": None, "rope_interleave": False},
    # V2-Lite's routing: plain greedy top-k over every expert.
    "v2-greedy": {
        "kind": "v2",
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "topk_method": "greedy",
    },
    # V2: no q bottleneck, group-limited softmax routing, two shared experts.
    "v2": {
        "kind": "v2",
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "topk_method": "group_limited_greedy",
    },
}


def _build(directory: Path, tokenizer: Tokenizer, variant: str) -> Any:
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    settings = dict(VARIANTS[variant])
    kind = settings.pop("kind")
    torch.manual_seed(5)
    model: Any
    if kind == "v3":
        model = DeepseekV3ForCausalLM(
            DeepseekV3Config(**_COMMON, **settings, num_hidden_layers=3, num_key_value_heads=4)
        )
        with torch.no_grad():  # HF starts the choice bias at zero: make it matter
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**_COMMON, **settings, num_hidden_layers=2))
    model.eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return model


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer
) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("deepseek")
    rng = random.Random(9)
    prompts = [[rng.randrange(100, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    out = {}
    for variant in VARIANTS:
        model = _build(root / variant, smollm2_tokenizer, variant)
        out[variant] = {
            "dir": root / variant,
            "model": model,
            "prompts": prompts,
            "expected": hf_greedy(model, prompts, max_new_tokens=NEW_TOKENS),
        }
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant: str, tiny: dict[str, dict[str, Any]]) -> None:
    case = tiny[variant]
    prompts, expected = case["prompts"], case["expected"]
    # max_num_batched_tokens=16: the longer prompts are prefilled in chunks that read the
    # latent cache of the chunks before them.
    llm = LLM(str(case["dir"]), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16)
    assert llm.engine.build_info["kv_backend"] == "torch-latent"
    assert [_greedy(llm, [p])[0] for p in prompts] == expected  # one at a time
    assert _greedy(llm, prompts) == expected  # batched: experts grouped across sequences


def test_prefix_cache_hits_read_the_latent_cache(tiny: dict[str, dict[str, Any]]) -> None:
    case = tiny["v3"]
    prompts = case["prompts"]
    longer = prompts[3] + prompts[2]  # 300 cacheable tokens, then 70 more
    expected = hf_greedy(case["model"], [longer], max_new_tokens=NEW_TOKENS)
    llm = LLM(str(case["dir"]), dtype="float32", kv_cache_memory="64MiB")
    _greedy(llm, [prompts[3]])
    out = llm.generate([longer], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    assert out.num_cached_tokens >= 288
    assert list(out.token_ids) == expected[0]


def test_the_pool_keeps_one_latent_vector_a_token(tiny: dict[str, dict[str, Any]]) -> None:
    """KV bytes a token, from the pool's own accounting: C + rope values a layer, against
    2 x heads x head dim for the plain attention of the same width."""
    llm = LLM(str(tiny["v3"]["dir"]), dtype="float32", kv_cache_memory="16MiB")
    engine = llm.engine
    config = engine.model_config
    fields = config.arch_fields
    assert isinstance(fields, DeepseekFields)
    spec = engine.kv_layout.spec
    assert spec == KVSpec.latent(32 + 8, 32, dtype="float32")
    per_token = engine.kv_pool.bytes // engine.kv_pool.num_tokens
    assert per_token == config.num_layers * (32 + 8) * 4
    plain = config.num_layers * 2 * config.num_heads * fields.qk_head_dim * 4
    assert plain / per_token > 4  # 4 heads of 24 for K and V, against 40 once
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.shape[-1] == 40 and v_cache.numel() == 0


def test_routing_matters(tiny: dict[str, dict[str, Any]]) -> None:
    """The same weights routed to other experts continue differently: the match above
    would fail if the choice bias or the groups were ignored."""
    case = tiny["v3"]
    model = case["model"]
    with torch.no_grad():
        saved = [layer.mlp.gate.e_score_correction_bias.clone() for layer in model.model.layers[1:]]
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        try:
            got = hf_greedy(model, case["prompts"], max_new_tokens=NEW_TOKENS)
        finally:
            for layer, bias in zip(model.model.layers[1:], saved, strict=True):
                layer.mlp.gate.e_score_correction_bias.copy_(bias)
    assert got != case["expected"]


def test_bfloat16_agrees(tiny: dict[str, dict[str, Any]]) -> None:
    case = tiny["v3"]
    llm = LLM(str(case["dir"]), dtype="bfloat16", kv_cache_memory="64MiB")
    assert isinstance(llm.engine.model, DeepseekModel)
    got = _greedy(llm, case["prompts"])
    first = sum(g[0] == e[0] for g, e in zip(got, case["expected"], strict=True))
    assert first >= 3, (got, case["expected"])


def test_what_it_cannot_run_is_refused_naming_it(
    tiny: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    for key, value, words in (
        ("moe_layer_freq", 2, "moe_layer_freq"),
        ("attention_bias", True, "attention_bias"),
        ("n_group", 3, "n_group"),
    ):
        directory = tmp_path / key
        shutil.copytree(tiny["v2"]["dir"], directory)
        config_file = directory / "config.json"
        raw = json.loads(config_file.read_text())
        raw[key] = value
        config_file.write_text(json.dumps(raw))
        with pytest.raises((UnsupportedModel, CorruptWeights), match=words):
            load_checkpoint(directory)


@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_grouped_experts_equal_transformers_bit_for_bit(
    variant: str, tiny: dict[str, dict[str, Any]]
) -> None:
    """One MoE layer on 200 rows: the experts run grouped (one slice each) and each row's
    experts are summed in the order of transformers' eager loop (ascending expert, from
    zero), so fp32 outputs are identical to it. (Its default ``grouped_mm`` sums in another
    order: the greedy tests above hold against that one.)"""
    case = tiny[variant]
    llm = LLM(str(case["dir"]), dtype="float32", kv_cache_memory="16MiB")
    model = llm.engine.model
    assert isinstance(model, DeepseekModel)
    layer = model.layers[1]
    assert layer.moe is not None
    h = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    reference = case["model"]
    default = reference.config._experts_implementation
    reference.set_experts_implementation("eager")
    try:
        with torch.no_grad():
            want = reference.model.layers[1].mlp(h.unsqueeze(0)).squeeze(0)
            got = model._moe(layer.moe, h, None)
    finally:
        reference.set_experts_implementation(default)
    assert torch.equal(got, want)


def test_multi_token_prediction_layers_are_dropped_and_fp8_refused(
    tiny: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A V3 checkpoint as DeepSeek ships it carries its MTP layer after the last one: it is
    not read (the tokens still match). A quantized checkpoint is refused, naming it."""
    from safetensors.torch import save_file

    case = tiny["v3"]
    directory = tmp_path / "with-mtp"
    shutil.copytree(case["dir"], directory)
    layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    mtp = {f"model.layers.{layers}.eh_proj.weight": torch.zeros(64, 128)}
    save_file(mtp, str(directory / "mtp.safetensors"))
    llm = LLM(str(directory), dtype="float32", kv_cache_memory="16MiB")
    assert _greedy(llm, case["prompts"][:2]) == case["expected"][:2]

    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    config_file.write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match="quantized checkpoints \\(fp8\\)"):
        load_checkpoint(directory)
