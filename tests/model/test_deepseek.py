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
from tests.gguf_writer import add_smollm2_vocab
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


@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_bfloat16_agrees(variant: str, tiny: dict[str, dict[str, Any]]) -> None:
    case = tiny[variant]
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
    """One MoE layer on 200 rows: the routed experts run grouped (one slice each, rows in
    the eager loop's order within it) and each row's experts are summed in the order of
    transformers' eager loop (ascending expert, from zero), so fp32 outputs are identical
    to it. (Its default ``grouped_mm`` sums in another order: the greedy tests above hold
    against that one.) The shared expert's gate and up run as one matmul here, two there:
    the whole layer agrees to rounding."""
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
    mlp = reference.model.layers[1].mlp
    try:
        with torch.no_grad():
            _, weights, index = mlp.gate(h)
            want = mlp.experts(h, index, weights)
            got = model._routed(layer.moe, h)
            want_layer = mlp(h.unsqueeze(0)).squeeze(0)
            got_layer = model._moe(layer.moe, h, None)
    finally:
        reference.set_experts_implementation(default)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_layer, want_layer, rtol=1e-5, atol=1e-5)


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


def _write_deepseek_gguf(path: Path, model: Any, smollm2_gguf_path: Path, experts_q8: bool) -> None:
    """The tiny checkpoint as llama.cpp's converter writes ``deepseek2``: one latent KV head,
    the ``_mla`` head sizes, experts stacked in one tensor a layer, ``kv_b`` split into a
    transposed ``k_b`` and ``v_b``; experts in Q8_0 blocks with ``experts_q8``."""
    import numpy as np
    from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    c = model.config
    writer = GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank is not None:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    writer.add_value_length(c.kv_lora_rank)
    writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    writer.add_value_length_mla(c.v_head_dim)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    writer.add_expert_weights_norm(c.norm_topk_prob)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)  # V3
    writer.add_expert_group_count(c.n_group)
    writer.add_expert_group_used_count(c.topk_group)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    writer.add_rope_scaling_type(gguf_rope_type("yarn"))
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    add_smollm2_vocab(writer, smollm2_gguf_path)
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    }
    nh = c.num_attention_heads
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", array)
        elif ".mlp.experts." in name:
            continue  # stacked below
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest == "self_attn.kv_b_proj.weight":
                kv_b = array.reshape(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
                k_b = kv_b[:, : c.qk_nope_head_dim].transpose(0, 2, 1).copy()
                writer.add_tensor(f"blk.{layer}.attn_k_b.weight", k_b)
                writer.add_tensor(
                    f"blk.{layer}.attn_v_b.weight", kv_b[:, c.qk_nope_head_dim :].copy()
                )
                continue
            writer.add_tensor(f"blk.{layer}.{names[rest]}", array)
    for layer in range(c.first_k_dense_replace, c.num_hidden_layers):
        mlp = model.model.layers[layer].mlp
        stacks = {
            "ffn_gate_exps": mlp.experts.gate_up_proj.detach()[:, : c.moe_intermediate_size],
            "ffn_up_exps": mlp.experts.gate_up_proj.detach()[:, c.moe_intermediate_size :],
            "ffn_down_exps": mlp.experts.down_proj.detach(),
        }
        for gguf_name, stack in stacks.items():
            array = stack.float().contiguous().numpy()
            if experts_q8:
                q = quantize(array, GGMLQuantizationType.Q8_0)
                writer.add_tensor(
                    f"blk.{layer}.{gguf_name}.weight", q, raw_shape=q.shape,
                    raw_dtype=GGMLQuantizationType.Q8_0,
                )  # fmt: skip
            else:
                writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_rope_type(name: str) -> Any:
    from gguf import RopeScalingType

    return RopeScalingType(name)


def test_a_llama_cpp_gguf_of_v3_matches_transformers(
    tiny: dict[str, dict[str, Any]], tmp_path: Path, smollm2_gguf_path: Path
) -> None:
    """The same weights in llama.cpp's ``deepseek2`` layout, read back: the experts from
    their stacks, ``kv_b`` from its halves, the routing and YaRN from the metadata."""
    case = tiny["v3"]
    path = tmp_path / "tiny-deepseek.gguf"
    _write_deepseek_gguf(path, case["model"], smollm2_gguf_path, experts_q8=False)
    ckpt = load_checkpoint(path)
    state = case["model"].state_dict()
    assert torch.equal(
        ckpt.weights["model.layers.1.self_attn.kv_b_proj.weight"],
        state["model.layers.1.self_attn.kv_b_proj.weight"],
    )
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16)
    assert llm.engine.model_config.architecture == "deepseek_v3"
    assert _greedy(llm, case["prompts"]) == case["expected"]


def test_a_gguf_keeps_its_experts_in_blocks_as_slices(
    tiny: dict[str, dict[str, Any]], tmp_path: Path, smollm2_gguf_path: Path
) -> None:
    """Experts stored in Q8_0 blocks stay in them, one view of the stack's rows each."""
    from kvgate.model.quant_tensor import QuantTensor

    case = tiny["v3"]
    path = tmp_path / "tiny-deepseek-q8.gguf"
    _write_deepseek_gguf(path, case["model"], smollm2_gguf_path, experts_q8=True)
    ckpt = load_checkpoint(path, keep_quantized=True)
    first = ckpt.weights["model.layers.1.mlp.experts.0.gate_proj.weight"]
    second = ckpt.weights["model.layers.1.mlp.experts.1.gate_proj.weight"]
    assert isinstance(first, QuantTensor) and isinstance(second, QuantTensor)
    assert first.shape == (32, 64) and second.shape == (32, 64)
    assert second.data.data_ptr() == first.data.data_ptr() + 32 * first.row_bytes  # no copy
    want = state_gate(case["model"], layer=1, expert=1)
    torch.testing.assert_close(second.dequantize(), want, atol=0.02, rtol=0.02)
    # Run on the block kernels (int8 activations) against the same blocks dequantized.
    native = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", gguf_blocks="native")
    if not native.engine.build_info["linear"].startswith("Q8_0"):
        pytest.skip("no block kernels on this machine (no C compiler)")
    plain = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", gguf_blocks="dequantize")
    got, want_tokens = _greedy(native, case["prompts"]), _greedy(plain, case["prompts"])
    assert sum(g[0] == w[0] for g, w in zip(got, want_tokens, strict=True)) >= 3


def state_gate(model: Any, layer: int, expert: int) -> torch.Tensor:
    experts = model.model.layers[layer].mlp.experts
    inter = model.config.moe_intermediate_size
    result: torch.Tensor = experts.gate_up_proj.detach()[expert, :inter].float()
    return result


def test_an_int8_latent_cache_keeps_a_quarter_of_the_bytes(tiny: dict[str, Any]) -> None:
    """``--kv-cache-dtype int8`` on the latent cache: one 40-value row a token and layer
    as 40 bytes and a scale (44, against 160 in float32), and the first tokens as in fp32."""
    case = tiny["v3"]
    llm = LLM(str(case["dir"]), dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype="int8")
    engine = llm.engine
    assert engine.build_info["kv_dtype"] == "int8"
    assert engine.kv_pool.bytes // engine.kv_pool.num_tokens == engine.model_config.num_layers * 44
    got = _greedy(llm, case["prompts"])
    first = sum(g[0] == e[0] for g, e in zip(got, case["expected"], strict=True))
    assert first >= 3, (got, case["expected"])
