"""Per-request LoRA adapters (``kvgate/model/lora.py``) against transformers + peft on tiny
random models: adapters made by ``peft.get_peft_model`` with non-zero B
(``init_lora_weights=False``) and saved by ``save_pretrained``; one adapter's logits and
greedy tokens, a step mixing rows of two adapters and of none in one forward, rsLoRA and a
subset of targets, and what is refused."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvgate.entrypoints.llm import LLM
from kvgate.errors import InvalidConfig
from kvgate.model.attention import AttentionMetadata, PrefillSlice
from kvgate.model.lora import LoraAdapter, LoraRows
from kvgate.tokenizer import Tokenizer
from tests.hf_reference import hf_greedy
from tests.lora_adapters import ALL, make_adapter
from tests.tiny_model import TINY_LLAMA, tiny_qwen2

NEW_TOKENS = 16
# fp32 logits against transformers + peft: the same weights, other summation orders.
ATOL = 1e-4


def _hf(kind: str, seed: int = 3, **overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "qwen2":
        return tiny_qwen2(seed)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()


def _save(model: Any, directory: Path, tokenizer: Tokenizer) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_hf(directory)
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> dict[str, Any]:
    """A tiny Llama as kvgate runs it (fp32) and as transformers does, and two adapters of
    it: ``a`` on every projection, ``b`` rsLoRA on q and v only."""
    root = tmp_path_factory.mktemp("lora")
    hf = _hf("llama")
    llm = LLM(str(_save(hf, root / "base", smollm2_tokenizer)), dtype="float32",
              kv_cache_memory="64MiB")  # fmt: skip
    config = llm.engine.model.config
    peft_a = make_adapter(hf, root / "a", seed=11)
    peft_b = make_adapter(hf, root / "b", seed=12, r=4, lora_alpha=6, use_rslora=True,
                          target_modules=["q_proj", "v_proj"])  # fmt: skip
    return {
        "root": root,
        "hf": hf,
        "llm": llm,
        "peft": {"a": peft_a, "b": peft_b},
        "adapter": {n: LoraAdapter(root / n, config) for n in ("a", "b")},
    }


def _prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49152) for _ in range(n)] for n in lens]


Meta = AttentionMetadata | list[AttentionMetadata]


class Run:
    """Sequences stepped together through ``model.forward`` on the engine's KV pool, each on
    blocks of its own with its adapter (or none): every prompt prefilled in one forward,
    then one forward a step decoding every sequence. Layers that share the pool's tensors
    (Gemma 3's sliding and global groups: ``KVLayout``) read and write other blocks."""

    def __init__(self, llm: LLM, prompts: list[list[int]], adapters: list[Any]) -> None:
        eng = llm.engine
        self.model, self.caches, self.bs = eng.model, eng.runner.kv_caches, eng.config.block_size
        self.tokens = [list(p) for p in prompts]
        self.adapters = adapters
        self.tables, at = [], 0
        for p in prompts:
            n = -(-(len(p) + NEW_TOKENS) // self.bs)
            self.tables.append(torch.arange(at, at + n))
            at += n
        self.stride = at
        # A layer's group: how many layers before it share its tensor (so its blocks).
        ptrs = [k.data_ptr() for k, _ in self.caches]
        self.groups = [ptrs[:i].count(ptr) for i, ptr in enumerate(ptrs)]

    def _slot(self, g: int, j: int, pos: int) -> int:
        block = int(self.tables[j][pos // self.bs]) + g * self.stride
        return block * self.bs + pos % self.bs

    def _metas(self, build: Any) -> Meta:
        """``build(g)`` (group g's metadata) for every layer; one for all where one group."""
        metas = {g: build(g) for g in set(self.groups)}
        return metas[0] if len(metas) == 1 else [metas[g] for g in self.groups]

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: Meta, rows: list[Any]
    ) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.model.forward(ids, pos, self.caches, meta, None, LoraRows.of(rows))
            return self.model.compute_logits(hidden).float()

    def prefill_step(self) -> tuple[torch.Tensor, torch.Tensor, Meta, list[Any]]:
        """Every prompt in one step: its ids, positions, metadata and rows' adapters."""
        ids = [t for p in self.tokens for t in p]
        rows = [a for p, a in zip(self.tokens, self.adapters, strict=True) for _ in p]
        starts = [0]
        for p in self.tokens:
            starts.append(starts[-1] + len(p))

        def build(g: int) -> AttentionMetadata:
            slots = [self._slot(g, j, i) for j, p in enumerate(self.tokens) for i in range(len(p))]
            slices = [
                PrefillSlice(starts[j], starts[j + 1], 0,
                             self.tables[j][: -(-len(p) // self.bs)] + g * self.stride)
                for j, p in enumerate(self.tokens)
            ]  # fmt: skip
            return AttentionMetadata(
                slot_mapping=torch.tensor(slots),
                num_decodes=0,
                decode_blocks=torch.empty(0, dtype=torch.long),
                decode_lens=torch.empty(0, dtype=torch.long),
                prefills=tuple(slices),
            )

        pos = torch.cat([torch.arange(len(p)) for p in self.tokens])
        return torch.tensor(ids), pos, self._metas(build), rows

    def prefill(self) -> list[torch.Tensor]:
        """Every prompt in one step: each sequence's logits [n, V]."""
        ids, pos, meta, rows = self.prefill_step()
        logits = self._forward(ids, pos, meta, rows)
        return list(logits.split([len(p) for p in self.tokens]))

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One token more for every sequence, in one step: logits [S, V]."""
        width = max(len(t) for t in self.tables)
        for seq, token in zip(self.tokens, tokens, strict=True):
            seq.append(token)

        def build(g: int) -> AttentionMetadata:
            tables = [F.pad(t + g * self.stride, (0, width - len(t))) for t in self.tables]
            return AttentionMetadata(
                slot_mapping=torch.tensor(
                    [self._slot(g, j, len(s) - 1) for j, s in enumerate(self.tokens)]
                ),
                num_decodes=len(self.tokens),
                decode_blocks=torch.cat(tables),
                decode_lens=torch.tensor([len(s) for s in self.tokens]),
                prefills=(),
            )

        pos = torch.tensor([len(s) - 1 for s in self.tokens])
        return self._forward(torch.tensor(tokens), pos, self._metas(build), self.adapters)

    def greedy(self) -> tuple[list[torch.Tensor], list[list[int]]]:
        """The prompts' logits and NEW_TOKENS greedy tokens of each sequence."""
        prompt_logits = self.prefill()
        out = [[int(lg[-1].argmax())] for lg in prompt_logits]
        for _ in range(NEW_TOKENS - 1):
            logits = self.decode([o[-1] for o in out])
            for o, row in zip(out, logits, strict=True):
                o.append(int(row.argmax()))
        return prompt_logits, out


def _peft_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def _agree(got: list[int], want: list[int]) -> None:
    """kvgate's greedy tokens are transformers' (which stops at EOS, id 2)."""
    assert got[: len(want)] == want


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_adapter_matches_peft(kind: str, tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    hf = _hf(kind)
    llm = LLM(str(_save(hf, tmp_path / "base", smollm2_tokenizer)), dtype="float32",
              kv_cache_memory="64MiB")  # fmt: skip
    ref = make_adapter(hf, tmp_path / "ad", seed=7)
    adapter = LoraAdapter(tmp_path / "ad", llm.engine.model.config)
    assert adapter.target_modules == set(ALL) and adapter.scale == 2.0 and adapter.name == "ad"
    prompt = _prompts(1, (40,))[0]
    logits, tokens = Run(llm, [prompt], [adapter]).greedy()
    want = _peft_logits(ref, prompt)
    torch.testing.assert_close(logits[0], want, rtol=0, atol=ATOL)
    # The adapter matters far beyond that tolerance.
    assert (want - _peft_logits(hf, prompt)).abs().max() > 1.0
    _agree(tokens[0], hf_greedy(ref, [prompt], NEW_TOKENS)[0])


def test_a_mixed_step_is_each_sequence_alone(llama: dict[str, Any]) -> None:
    """Rows of adapter a, of none, of b (rsLoRA, q and v only) and of a again, prefilled in
    one forward and decoded in one forward a step: each sequence's logits as it alone with
    its adapter (the base rows as the base model), its tokens as transformers + peft's."""
    llm, ad, ref = llama["llm"], llama["adapter"], llama["peft"]
    prompts = _prompts(2, (30, 7, 25, 12))
    adapters = [ad["a"], None, ad["b"], ad["a"]]
    lora = LoraRows.of([a for a, p in zip(adapters, prompts, strict=True) for _ in p])
    assert lora is not None and [a for a, _ in lora.groups] == [ad["a"], ad["b"]]
    assert lora.groups[1][1] is not None and lora.groups[1][1].tolist() == list(range(37, 62))
    mixed_logits, mixed = Run(llm, prompts, adapters).greedy()
    for j, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        alone_logits, alone = Run(llm, [prompt], [adapter]).greedy()
        # Equal but for fp32 matmuls' summation order over other row counts.
        torch.testing.assert_close(mixed_logits[j], alone_logits[0], rtol=0, atol=ATOL)
        assert mixed[j] == alone[0]
        model = llama["hf"] if adapter is None else ref["a" if adapter is ad["a"] else "b"]
        torch.testing.assert_close(mixed_logits[j], _peft_logits(model, prompt), rtol=0, atol=ATOL)
        _agree(mixed[j], hf_greedy(model, [prompt], NEW_TOKENS)[0])


def test_rslora_and_a_subset_of_targets(llama: dict[str, Any]) -> None:
    b = llama["adapter"]["b"]
    assert b.use_rslora and b.scale == 6 / 2 and b.target_modules == {"q_proj", "v_proj"}
    # q and v share qkv's factors: A stacked [2r, H], B block-diagonal with k's rows zero.
    f = b.factors[(0, "qkv")]
    assert f.a.shape == (8, 64) and f.b.shape == (64 + 32 + 32, 8)
    assert not f.b[64:96].any() and not f.b[:64, 4:].any() and not f.b[96:, :4].any()
    assert set(b.factors) == {(0, "qkv"), (1, "qkv")}
    a_q, b_q = b.weights[(1, "q_proj")]
    peft_q = llama["peft"]["b"].base_model.model.model.layers[1].self_attn.q_proj
    assert torch.equal(a_q, peft_q.lora_A["default"].weight)
    assert torch.equal(b_q, peft_q.lora_B["default"].weight)
    assert b.nbytes == 2 * (8 * 64 + 128 * 8) * 4


def test_without_adapters_the_step_is_the_base_model(llama: dict[str, Any]) -> None:
    """No adapter for any row is no LoraRows at all, and an empty one runs as None does:
    bit for bit the forward without ``lora``."""
    assert LoraRows.of([None, None]) is None
    model, caches = llama["llm"].engine.model, llama["llm"].engine.runner.kv_caches
    prompt = _prompts(3, (20,))[0]
    ids, pos, meta, _ = Run(llama["llm"], [prompt], [None]).prefill_step()
    with torch.no_grad():
        plain = model.forward(ids, pos, caches, meta)
        empty = model.forward(ids, pos, caches, meta, None, LoraRows(len(prompt), ()))
        assert torch.equal(plain, empty)
        bad = LoraRows(3, ((llama["adapter"]["a"], None),))
        with pytest.raises(ValueError, match="LoRA rows for 3 tokens in a step of 20"):
            model.forward(ids, pos, caches, meta, None, bad)


def test_bfloat16_with_adapters_runs_per_op_and_agrees(
    llama: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, the mixed step of the fp32 test: steps with an adapter never take the native
    decode layers (they cannot add its deltas); the logits agree with fp32 transformers +
    peft within bf16's rounding (10% of the largest; ~5% seen), the first greedy token on at least
    three prompts of four (as ``test_llama_variants``' bf16 test: near-ties may flip)."""
    root, ref = llama["root"], llama["peft"]
    llm = LLM(str(root / "base"), dtype="bfloat16", kv_cache_memory="64MiB")
    model = llm.engine.model
    ad = {n: LoraAdapter(root / n, model.config) for n in ("a", "b")}
    prompts = _prompts(5, (24, 9, 30, 16))
    adapters = [ad["a"], None, ad["b"], ad["a"]]
    native = model.native_decode
    calls: list[int] = []
    if native is not None:
        start = native.start
        monkeypatch.setattr(native, "start", lambda *a: calls.append(1) or start(*a))
    logits, tokens = Run(llm, prompts, adapters).greedy()
    assert calls == []
    agree = 0
    for j, prompt in enumerate(prompts):
        adapter = adapters[j]
        reference = llama["hf"] if adapter is None else ref["a" if adapter is ad["a"] else "b"]
        want = _peft_logits(reference, prompt)
        err = (logits[j] - want).abs().max()
        assert err < 0.1 * want.abs().max(), (j, err)
        agree += tokens[j][0] == hf_greedy(reference, [prompt], 1)[0][0]
    assert agree >= 3, tokens
    if native is not None:  # the same decodes without adapters do take them
        Run(llm, prompts, [None] * 4).greedy()
        assert calls


def test_gemma3_adapter_matches_peft(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    """Gemma 3 takes the same deltas after the same four fused linears."""
    from transformers import Gemma3ForCausalLM

    from tests.model.test_gemma3 import _hf_config

    torch.manual_seed(3)
    hf = Gemma3ForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # as test_gemma3: norms that matter, embeddings that do not drown
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            if "embed" in name:
                p.mul_(0.05)
    llm = LLM(str(_save(hf, tmp_path / "base", smollm2_tokenizer)), dtype="float32",
              kv_cache_memory="64MiB")  # fmt: skip
    ref = make_adapter(hf, tmp_path / "ad", seed=8, target_modules=["k_proj", "o_proj", "up_proj"])
    adapter = LoraAdapter(tmp_path / "ad", llm.engine.model.config)
    prompts = _prompts(6, (40, 11))
    logits, tokens = Run(llm, prompts, [adapter, None]).greedy()
    for j, model in enumerate((ref, hf)):
        want = _peft_logits(model, prompts[j])
        torch.testing.assert_close(logits[j], want, rtol=0, atol=ATOL)
        _agree(tokens[j], hf_greedy(model, [prompts[j]], NEW_TOKENS)[0])
    assert (_peft_logits(ref, prompts[0]) - _peft_logits(hf, prompts[0])).abs().max() > 0.1


def _config_of(directory: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((directory / "adapter_config.json").read_text())
    return loaded


def _edit(source: Path, directory: Path, **settings: Any) -> Path:
    directory.mkdir()
    (directory / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    config = {**_config_of(source), **settings}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def test_what_is_refused(llama: dict[str, Any], tmp_path: Path) -> None:
    config = llama["llm"].engine.model.config
    good = llama["root"] / "a"

    def refused(path: Path, fragment: str) -> None:
        with pytest.raises(InvalidConfig, match=fragment) as info:
            LoraAdapter(path, config)
        assert info.value.param == "lora_adapter"

    # Made on another model: a hidden size of 32, or a layer more than the model has.
    narrow = _hf("llama", hidden_size=32, intermediate_size=80)
    make_adapter(narrow, tmp_path / "narrow", seed=1, target_modules=["q_proj"])
    refused(
        tmp_path / "narrow",
        r"tensor 'model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' has shape \[8, 32\], "
        r"expected \[8, 64\]",
    )
    deeper = _hf("llama", num_hidden_layers=3)
    make_adapter(deeper, tmp_path / "deeper", seed=1, target_modules=["down_proj"])
    refused(tmp_path / "deeper", "is for layer 2; the model has 2 layers")
    # What peft can express and kvgate does not run.
    make_adapter(llama["hf"], tmp_path / "bias", seed=1, bias="all")
    refused(tmp_path / "bias", "bias 'all' is not supported")
    make_adapter(llama["hf"], tmp_path / "dora", seed=1, use_dora=True, target_modules=["q_proj"])
    refused(tmp_path / "dora", "use_dora")
    head = _edit(good, tmp_path / "head", target_modules=["q_proj", "lm_head"])
    refused(head, "target module 'lm_head' is not supported")
    refused(_edit(good, tmp_path / "save", modules_to_save=["lm_head"]), "modules_to_save")
    refused(_edit(good, tmp_path / "fan", fan_in_fan_out=True), "fan_in_fan_out")
    refused(_edit(good, tmp_path / "layers", layers_to_transform=[0, 5]),
            r"layers_to_transform \[5\] are beyond the model's 2 layers")  # fmt: skip
    # Files missing.
    missing = _edit(good, tmp_path / "missing")
    (missing / "adapter_model.safetensors").unlink()
    refused(missing, "no adapter_model.safetensors")
    refused(tmp_path / "nowhere", "no adapter_config.json")
    # The check against another model, after loading.
    with pytest.raises(InvalidConfig, match="has shape"):
        llama["adapter"]["a"].check(dataclasses.replace(config, intermediate_size=320))
    make_adapter(llama["hf"], tmp_path / "q", seed=1, target_modules=["q_proj"])
    q_only = LoraAdapter(tmp_path / "q", config)
    q_only.check(config)
    with pytest.raises(InvalidConfig, match="layer 0's qkv has 96 outputs in this model, 128"):
        q_only.check(dataclasses.replace(config, num_kv_heads=1))  # k and v untargeted


def test_a_model_class_without_lora_refuses_it(
    llama: dict[str, Any], tmp_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tests.model.test_deepseek import _COMMON

    torch.manual_seed(5)
    settings = {**_COMMON, "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "greedy"}
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(**settings, num_hidden_layers=2)).eval()
    llm = LLM(str(_save(hf, tmp_path / "ds", smollm2_tokenizer)), dtype="float32",
              kv_cache_memory="16MiB")  # fmt: skip
    model = llm.engine.model
    assert not model.supports_lora and llama["llm"].engine.model.supports_lora
    run = Run(llm, [[5, 6, 7]], [llama["adapter"]["a"]])
    with pytest.raises(InvalidConfig, match=r"DeepseekModel \(deepseek.*\) does not support LoRA"):
        run.prefill()
    assert Run(llm, [[5, 6, 7]], [None]).prefill()[0].shape == (3, 49152)  # None still runs
