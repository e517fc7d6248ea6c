"""Prefix-cache hits across KV-cache groups on engines of tiny checkpoints written by
transformers: Gemma 3 (a 16-token sliding window beside full attention), Llama 4 (24-token
chunked local attention beside a NoPE full-attention layer) and Bamba (Mamba-2 state layers
beside full attention). A warm prompt shares a prefix of each length (inside and past the
window, crossing a chunk, ending at and off block boundaries) with the measured prompt; the
measured prompt's greedy tokens must equal transformers' (the cold run's), its hit must be the
longest one every group serves (vLLM's hybrid allocator), and every scenario ends with the
block-accounting check. Preemption with prefix caching resumes requests from hits in every
group at once."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from tests.helpers import check_block_accounting, float32_llm, random_prompts
from tests.models.test_gemma3 import GEMMA3_CONFIG
from tests.models.test_llama4 import CONFIG as LLAMA4_CONFIG
from tests.models.utils import assert_scenario, prompts_for, transformers_greedy

BLOCK_SIZE, MAX_TOKENS = 8, 6
#: The measured prompt's length (8 full blocks and 3 tokens; its hit is at most 64 tokens).
PROMPT_LEN = 67
#: Shared prefix lengths: within the first block, inside the 16-token window, block-aligned
#: past the window, crossing the 24-token chunk, and the whole hit-able prompt.
SHARED = (5, 12, 16, 29, 40, 53, 64, 66)

CHECKPOINTS = {
    "gemma3": ("Gemma3ForCausalLM", dict(GEMMA3_CONFIG, seed=63, tie_word_embeddings=True)),
    "llama4": ("Llama4ForCausalLM", dict(LLAMA4_CONFIG, seed=2)),
    "bamba": ("BambaForCausalLM", dict(
        seed=5, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=2)),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def model(request, checkpoint_factory):
    arch, config = CHECKPOINTS[request.param]
    return request.param, checkpoint_factory(arch, **config)


def _prompts(shared: int, warm_tail: int) -> tuple[list[int], list[int]]:
    """(warm prompt, measured prompt): the warm one is the measured one's first ``shared``
    tokens then ``warm_tail`` others."""
    measured, tail = random_prompts([PROMPT_LEN, warm_tail], 1000, seed=shared)
    tail = [t if t != measured[shared + i] else t + 1 for i, t in enumerate(tail)] if shared + warm_tail <= PROMPT_LEN else tail
    return measured[:shared] + tail, measured


def _expected_hit(name: str, warm: list[int], shared: int) -> int:
    """The longest hit valid for every group when nothing was evicted: the warm prompt's
    shared full blocks (attention groups: the sliding window's and chunk's blocks are among
    them); with state layers, only where the warm prompt saved its state (its last full block
    before its last token) if that lies within the shared blocks."""
    shared_blocks = min(shared, PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE
    if name != "bamba":
        return shared_blocks
    save_point = (len(warm) - 1) // BLOCK_SIZE * BLOCK_SIZE
    return save_point if save_point <= shared_blocks else 0


@pytest.mark.parametrize("warm_tail", [1, 11])
@pytest.mark.parametrize("max_num_batched_tokens", [16, 256])
def test_warm_hit_equals_cold_and_transformers(model, warm_tail, max_num_batched_tokens):
    """One warm prompt, then the measured one, per shared length (the prefix cache reset
    between): the measured prompt's tokens are transformers' and its hit is the expected one."""
    name, path = model
    llm = float32_llm(path, dict(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                                 max_num_batched_tokens=max_num_batched_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for shared in SHARED:
        warm, measured = _prompts(shared, warm_tail)
        assert llm.llm_engine.reset_prefix_cache() is not False
        llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": measured}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == transformers_greedy(path, [measured], MAX_TOKENS)[0], (
            f"{name}: shared {shared}, hit {out.num_cached_tokens}")
        assert (out.num_cached_tokens or 0) == _expected_hit(name, warm, shared), f"{name}: shared {shared}"
        check_block_accounting(llm)


def test_hits_after_eviction_and_in_one_batch(model):
    """A cache of a few requests' blocks: warm prompts of every shared length, then all the
    measured prompts in one batch, twice; evictions leave each group different blocks, and
    every hit taken must still give transformers' tokens."""
    name, path = model
    llm = float32_llm(path, dict(block_size=BLOCK_SIZE, enable_prefix_caching=True, max_num_batched_tokens=32,
                                 max_model_len=128, kv_blocks=40, max_num_seqs=4))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # A state is saved at a prompt's last block boundary: a warm prompt one token past the
    # shared prefix saves it where the measured prompt can hit it.
    pairs = [_prompts(shared, 1 if name == "bamba" else 11) for shared in SHARED]
    # The measured prompts in the reverse order: the last warm prompts' blocks are still cached.
    measured = [m for _, m in reversed(pairs)]
    expected = transformers_greedy(path, measured, MAX_TOKENS)
    hits = 0
    for _ in range(2):
        llm.generate([{"prompt_token_ids": w} for w, _ in pairs], params, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": m} for m in measured], params, use_tqdm=False)
        for shared, out, ref in zip(reversed(SHARED), outs, expected):
            assert list(out.outputs[0].token_ids) == ref, f"{name}: shared {shared}, hit {out.num_cached_tokens}"
            hits += out.num_cached_tokens or 0
        check_block_accounting(llm)
    assert hits > 0


def test_preemption_with_prefix_caching(model):
    """Too few blocks for the batch (the prompts twice) with prefix caching on: preempted
    requests resume from hits on their own and the others' blocks (in every group at once)
    and still give transformers' tokens."""
    name, path = model
    assert_scenario(path, "preemption", prompts_for(1000, (20, 45, 90)), 8, enable_prefix_caching=True)
