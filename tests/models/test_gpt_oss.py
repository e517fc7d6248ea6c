"""gpt-oss: greedy token-identical to transformers (float32) under chunked prefill, preemption
and prefix caching (attention sinks, alternating 16-token windows, YaRN rope, biased router and
experts with a clamped SwiGLU whose clamp the activations reach); an MXFP4 checkpoint (the
experts quantized by an encoder of the OCP MX spec) loads dequantized and equals transformers
on the dequantized weights."""

from __future__ import annotations

import pytest

from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

# swiglu_limit 1.0: the expert activations (std ~0.7 here) pass the clamp often. YaRN as the
# published configs (no truncation), its original context 64 tokens: the prompts pass it.
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64, rope_theta=150000.0)
CONFIG = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=2,
              sliding_window=16, swiglu_limit=1.0, swiglu_alpha=1.5, rope_parameters=YARN, rope_theta=150000.0,
              max_position_embeddings=256)


@pytest.fixture(scope="module")
def gpt_oss(checkpoint_factory):
    return checkpoint_factory("GptOssForCausalLM", seed=3, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(gpt_oss, scenario):
    assert_scenario(gpt_oss, scenario, prompts_for(1024))
