"""Mamba-2 (every layer a ``MambaMixer2`` on the state cache, no attention): greedy output
token-identical to transformers float32 with prompts cut into chunks mid-way, decodes and
chunks of other requests in one step, more requests than state slots (slots reused), and
prefix-cache hits that restore saved states; what does not compose with state layers
refused at start-up."""

from __future__ import annotations

import logging

import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.core import EngineCore
from tests.models.utils import assert_scenario, prompts_for

#: Prompts cut by the 16-token steps of the chunked_prefill scenario, past the 16-token SSD chunks,
#: and a one-token prompt that starts in a slot another request left (decoded from a zeroed state).
PROMPT_LENGTHS, MAX_TOKENS = (20, 45, 1, 90), 8


@pytest.fixture(scope="module")
def mamba2(checkpoint_factory):
    return checkpoint_factory("Mamba2ForCausalLM", seed=5, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2,
                              state_size=16, conv_kernel=4, chunk_size=16, expand=2)


def test_mamba2_greedy_matches_transformers(mamba2, tokenizer, caplog):
    """16-token steps: prompts in chunks, each continuing its state; two requests at a time,
    so the later ones start in slots others left."""
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = assert_scenario(mamba2, "chunked_prefill", prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS,
                              max_num_seqs=2, enable_prefix_caching=False)
    assert "KV cache: no attention layers; state: 2 slots of" in caplog.text
    assert llm.llm_engine.engine_core.scheduler.max_num_running_observed == 2


def test_mamba2_prefix_cache_hits_restore_saved_states(mamba2, tokenizer, caplog):
    """The prompts twice: the second pass starts each from the state saved at its last block
    boundary (the first pass cut its prefill there)."""
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert_scenario(mamba2, "prefix_caching", prompts_for(len(tokenizer), PROMPT_LENGTHS), MAX_TOKENS,
                        max_num_batched_tokens=32, max_num_seqs=4)
    assert "Prefix caching with state layers (Mamba2ForCausalLM: 2 of 2 layers)" in caplog.text
    assert "state: 12 slots of" in caplog.text  # three per request with prefix caching


@pytest.mark.parametrize(("kwargs", "setting"), [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}},
     r"speculative decoding \(speculative_config\)"),
    ({"enable_lora": True}, r"LoRA \(enable_lora\)"),
])
def test_what_does_not_compose_with_state_layers_is_refused(mamba2, kwargs, setting):
    config = EngineArgs(model=str(mamba2), dtype="float32", **kwargs).create_engine_config()
    with pytest.raises(ValueError, match=f"^{setting} is not supported with Mamba2ForCausalLM, whose 2 of 2 layers "
                                         "keep a recurrent state"):
        EngineCore(config)
