"""Nemotron-H (one mixer per layer by ``hybrid_override_pattern``: Mamba-2 on the state cache,
attention without rope on the paged KV cache, a relu2 MLP that keeps no cache): greedy output
token-identical to transformers float32 with prompts cut into chunks mid-way beside decodes,
and under preemption (a preempted request gives back its blocks and its state slot)."""

from __future__ import annotations

import pytest

from tests.models.utils import assert_scenario, prompts_for

PROMPT_LENGTHS, MAX_TOKENS = (20, 45, 90), 8
#: Fewer sequences: the state slots of three mixer layers fit the test cache.
ENGINE = {"max_num_seqs": 16}


@pytest.fixture(scope="module")
def nemotron_h(checkpoint_factory):
    return checkpoint_factory(
        "NemotronHForCausalLM", seed=8, hybrid_override_pattern="M*-M", head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, intermediate_size=128)


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_nemotron_h_greedy_matches_transformers(nemotron_h, scenario, tokenizer):
    engine = ENGINE if scenario == "chunked_prefill" else {}
    assert_scenario(nemotron_h, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS, **engine)
