"""Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer: each layer in an
attention group of the paged KV cache and in a state group; µP multipliers): greedy output
token-identical to transformers float32 with prompts cut into chunks mid-way beside decodes,
under preemption (a preempted request gives back its blocks and its state slot) and with
prefix-cache hits (KV blocks and a saved state), with the gated RMSNorm after the gate; without
the mixer's norm (``mamba_rms_norm`` False, biases on) under chunked prefill, its logprobs equal
to transformers' (``lm_head_multiplier``)."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_interface import FullAttentionSpec, MambaSpec
from pagedllm.worker.kv_cache_sizing import kv_cache_groups
from tests.models.utils import assert_logprobs_match, assert_scenario, prompts_for

#: Two prompts (every layer is a hybrid: each prompt costs twice a Bamba layer's work), both
#: cut into chunks.
PROMPT_LENGTHS, MAX_TOKENS = (20, 60), 8
#: Fewer sequences: the state slots of every layer fit the test cache.
ENGINE = {"max_num_seqs": 16}
#: A mixer of mamba_d_ssm channels (not mamba_expand x hidden), n_groups 2, and µP factors
#: that all differ from 1.
_FALCON = dict(
    mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
    mamba_chunk_size=16, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7], ssm_in_multiplier=1.3, ssm_out_multiplier=0.6,
    attention_in_multiplier=0.9, attention_out_multiplier=1.4, key_multiplier=0.75, mlp_multipliers=[1.2, 0.8],
    embedding_multiplier=2.0, lm_head_multiplier=0.7,
)


@pytest.fixture(scope="module")
def falcon_h1(checkpoint_factory):
    return checkpoint_factory("FalconH1ForCausalLM", seed=11, mamba_rms_norm=True, mamba_norm_before_gate=True,
                              **_FALCON)


@pytest.fixture(scope="module")
def falcon_h1_no_norm(checkpoint_factory):
    return checkpoint_factory("FalconH1ForCausalLM", seed=12, mamba_rms_norm=False,
                              projectors_bias=True, mamba_proj_bias=True, attention_bias=True, mlp_bias=True,
                              **_FALCON)


def test_falcon_h1_layers_join_an_attention_and_a_state_group(falcon_h1):
    config = EngineArgs(model=str(falcon_h1), dtype="float32").create_engine_config()
    groups = kv_cache_groups(config)
    assert [(g.layer_indices, type(g.kv_cache_spec)) for g in groups.groups] == [((0, 1), FullAttentionSpec)]
    assert [(g.layer_indices, type(g.kv_cache_spec)) for g in groups.state_groups] == [((0, 1), MambaSpec)]
    assert groups.state_group_of_layer() == {0: 1, 1: 1}


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption", "prefix_caching"])
def test_falcon_h1_greedy_matches_transformers(falcon_h1, scenario, tokenizer):
    engine = {} if scenario == "preemption" else ENGINE
    assert_scenario(falcon_h1, scenario, prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS, **engine)


def test_falcon_h1_without_mixer_norm_matches_transformers(falcon_h1_no_norm, tokenizer):
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    llm = assert_scenario(falcon_h1_no_norm, "chunked_prefill", prompts, MAX_TOKENS, **ENGINE)
    assert_logprobs_match(llm, falcon_h1_no_norm, prompts[0])  # lm_head_multiplier keeps the argmax
