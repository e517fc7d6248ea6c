"""Multi-LoRA with speculative decoding: a batch mixing four adapters (two device slots) and
base-model requests, drafted by the n-gram proposer, a base draft model or an EAGLE-3 head
(drafts come without the adapter, the head reading the adapted target's hidden states; the
target verifies them with it), gives the same greedy tokens as
transformers on each PEFT-merged model."""

from __future__ import annotations

import pytest

from tests.helpers import check_block_accounting, random_prompts
from tests.lora.test_lora_greedy_equality import PROMPT_LENGTHS, _make_llm, check_mixed_batch
from tests.spec_decode.conftest import llama_eagle_heads, noisy_llama_draft  # noqa: F401 (fixtures)
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats, spec_configs


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_lora_with_spec_decode_matches_merged_transformers(method, tiny_llama, peft_adapters, noisy_llama_draft,
                                                           llama_eagle_heads, tokenizer):
    llm = _make_llm(tiny_llama, {"max_loras": 2, "max_cpu_loras": 2,
                                 "speculative_config": spec_configs(noisy_llama_draft, llama_eagle_heads)[method]})
    stats = record_spec_stats(llm)
    check_mixed_batch(llm, tiny_llama, peft_adapters, random_prompts(PROMPT_LENGTHS, len(tokenizer), seed=7))
    assert stats.num_drafts > 0, stats
    if method == "draft_model":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    check_block_accounting(llm)
