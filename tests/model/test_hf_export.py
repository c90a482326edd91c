from __future__ import annotations

from pathlib import Path

import torch

from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.hf_export import save_hf_checkpoint


def test_export_round_trips_through_our_loader_and_transformers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    original = load_checkpoint(tiny_llama_dir)
    out = save_hf_checkpoint(original, tmp_path / "export", torch.float32)
    again = load_checkpoint(out)
    assert again.config == original.config
    assert again.weights.keys() == original.weights.keys()
    for name, tensor in original.weights.items():
        assert torch.equal(again.weights[name], tensor), name
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(hf.state_dict()[name], tensor), name
    assert again.tokenizer.encode("hello 世界") == original.tokenizer.encode("hello 世界")
