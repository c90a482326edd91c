"""Steps built by hand for tests that drive a model directly, without the scheduler."""

from __future__ import annotations

import torch

from kvgate.model.attention import AttentionMetadata, PrefillSlice


def one_prefill(n: int, block_size: int) -> AttentionMetadata:
    """One prompt of ``n`` tokens prefilled whole, its K/V written from slot 0 on."""
    return AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decodes=0,
        decode_blocks=torch.empty(0, dtype=torch.long),
        decode_lens=torch.empty(0, dtype=torch.long),
        prefills=(PrefillSlice(0, n, 0, torch.arange(-(-n // block_size))),),
    )
