"""``-tp 2`` on the state layers: heads split over two worker processes, each rank's state cache
holding its own heads' conv and recurrent states. Mamba-2 (Bamba, one B / C group: a copy of it
on each rank, the gated norm's group spanning both ranks; likewise Nemotron-H, Granite 4 and
Falcon-H1 with one group) and the Gated DeltaNet (Qwen3-Next,
one key head and its two value heads per rank) give transformers' greedy tokens (float32)
under chunked prefill, prompts past the chunked scans' block bounds; the state shapes the
engine sizes its cache by are the ranks' own. One engine per family."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.worker.kv_cache_sizing import kv_cache_groups
from tests.helpers import can_host_workers, check_block_accounting
from tests.models import test_qwen3_next
from tests.models.utils import prompts_for, transformers_greedy

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

MAX_TOKENS = 5
#: (architecture, config, each rank's (conv state, ssm state) shapes per slot).
FAMILIES = {
    "mamba2": ("BambaForCausalLM", dict(seed=81, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8,
                                        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                                        mamba_chunk_size=16, mamba_expand=2),
               ((64 + 2 * 16, 3), (4, 16, 16))),
    # The other Mamba-2 families with one B / C group (as their released checkpoints): the
    # copies and the gated norm spanning both ranks, under each one's own blocks.
    "nemotron_h": ("NemotronHForCausalLM", dict(seed=83, hybrid_override_pattern="M*-M", head_dim=16, mamba_num_heads=8,
                                                mamba_head_dim=16, n_groups=1, ssm_state_size=16, conv_kernel=4,
                                                chunk_size=16, intermediate_size=128),
                   ((64 + 2 * 16, 3), (4, 16, 16))),
    "granite4": ("GraniteMoeHybridForCausalLM", dict(
        seed=84, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=0,
        position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=2, shared_intermediate_size=96),
                 ((64 + 2 * 16, 3), (4, 16, 16))),
    "falcon_h1": ("FalconH1ForCausalLM", dict(seed=85, num_hidden_layers=2, mamba_rms_norm=True, mamba_d_ssm=96,
                                              mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                                              mamba_d_conv=4, mamba_chunk_size=16),
                  ((48 + 2 * 16, 3), (3, 16, 16))),
    "gated_deltanet": ("Qwen3NextForCausalLM", dict(test_qwen3_next.CONFIG, seed=82),
                       ((2 * 16 + 2 * 8, 3), (2, 16, 8))),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_equal_transformers(family, checkpoint_factory, tokenizer):
    arch, config, rank_shapes = FAMILIES[family]
    path = checkpoint_factory(arch, **config)
    engine = dict(dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20, block_size=8,
                  max_num_batched_tokens=16, max_num_seqs=4)
    groups = kv_cache_groups(EngineArgs(model=str(path), **engine).create_engine_config())
    assert {g.kv_cache_spec.shapes for g in groups.state_groups} == {rank_shapes}
    prompts = prompts_for(len(tokenizer), (3, 20, 70))
    llm = LLM(str(path), **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy(path, prompts, MAX_TOKENS)
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_groups_that_do_not_divide_the_ranks_are_a_clear_error(checkpoint_factory):
    """3 B / C groups over 2 ranks can be neither split nor copied whole: a start-up error."""
    path = checkpoint_factory("BambaForCausalLM", seed=86, num_hidden_layers=2, attn_layer_indices=[1],
                              mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=3, mamba_d_state=16, mamba_d_conv=4,
                              mamba_chunk_size=16, mamba_expand=2, hidden_size=48)
    with pytest.raises(ValueError, match="n_groups 3 and tensor_parallel_size 2 must divide one another"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20)
