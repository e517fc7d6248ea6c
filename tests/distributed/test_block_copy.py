"""``block_copy``: a request's KV moves between caches of other block sizes and block ids,
in both cache layouts (keys and values; MLA's one latent per token), token for token."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.kv_transfer.block_copy import gather_tokens, scatter_tokens, token_slots

NUM_TOKENS = 21


@pytest.mark.parametrize("shape", [(2, 0, 0, 2, 4), (0, 0, 6)], ids=["kv", "mla"])
def test_tokens_survive_a_change_of_block_size_and_ids(shape):
    def cache(num_blocks: int, block_size: int) -> torch.Tensor:
        dims = [num_blocks, block_size] if len(shape) == 3 else [2, num_blocks, block_size]
        return torch.zeros(*dims, *shape[len(dims):])

    source, target = cache(8, 16), cache(12, 4)
    src_ids, dst_ids = [5, 2], [11, 0, 7, 3, 9, 1]
    src_slots = token_slots(src_ids, NUM_TOKENS, 16, source.device)
    flat = source.flatten(1, 2) if source.dim() == 5 else source.flatten(0, 1)
    values = torch.randn(flat[:, src_slots].shape if source.dim() == 5 else flat[src_slots].shape)
    if source.dim() == 5:
        flat[:, src_slots] = values
    else:
        flat[src_slots] = values
    tokens = gather_tokens(source, src_slots)
    dst_slots = token_slots(dst_ids, NUM_TOKENS, 4, target.device)
    scatter_tokens(target, dst_slots, tokens)
    assert torch.equal(gather_tokens(target, dst_slots), values)
    # Token 5 of the request: block dst_ids[5 // 4] = 0, offset 1; no other slot was written.
    token5 = target[:, 0, 1] if target.dim() == 5 else target[0, 1]
    assert torch.equal(token5, values[:, 5] if target.dim() == 5 else values[5])
    slots = target.flatten(1, 2).transpose(0, 1) if target.dim() == 5 else target.flatten(0, 1)
    written = slots.reshape(slots.shape[0], -1).ne(0).any(-1)
    assert torch.equal(written.nonzero().flatten().sort().values, dst_slots.sort().values)

def test_kv_of_another_shape_is_refused():
    cache = torch.zeros(2, 4, 16, 2, 4)
    slots = token_slots([1], 3, 16, cache.device)
    with pytest.raises(ValueError, match="the two engines must serve the same model"):
        scatter_tokens(cache, slots, torch.zeros(2, 3, 1, 4))
