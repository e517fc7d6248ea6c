"""EAGLE / EAGLE-3 heads (``speculative_config`` methods "eagle" and "eagle3").

Greedy equality under every scheduler scenario is in test_spec_greedy_equality.py (random
heads: drafts almost never accepted). Here: heads constructed to reproduce their one-layer
target exactly accept every draft (tests.fixtures.eagle_heads: this checks that the head
reads the next token at each position, chains its drafts, and maps EAGLE-3's draft
vocabulary); seeded sampling is unchanged; the target's layer inputs that EAGLE-3 reads
match transformers'; and bad configs fail at start-up naming the key.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from tests.fixtures.eagle_heads import make_eagle_head
from tests.helpers import check_block_accounting, hf_model, model_runner, random_prompts
from tests.spec_decode.test_spec_greedy_equality import assert_every_draft_accepted, record_spec_stats


def eagle_llm(target, method: str, head, k: int, **kwargs) -> LLM:
    return LLM(str(target), dtype="float32", kv_cache_memory_bytes=8 << 20,
               speculative_config={"method": method, "model": str(head), "num_speculative_tokens": k,
                                   "enable_adaptive_k": False}, **kwargs)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("max_num_batched_tokens", [None, 32])
def test_exact_head_accepts_every_draft(method, max_num_batched_tokens, bigram_target, exact_eagle_heads, tokenizer):
    """k = 4 drafts per step, all accepted; with chunked prefill (32-token steps) too."""
    kwargs = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    llm = eagle_llm(bigram_target, method, exact_eagle_heads[method], 4, **kwargs)
    assert_every_draft_accepted(llm, bigram_target, random_prompts([3, 20, 50, 90], len(tokenizer), seed=5))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_seeded_sampling_is_unchanged_and_reproducible(method, bigram_target, exact_eagle_heads, tokenizer):
    """Drafts are the head's argmax whatever the temperature; the target's own seeded
    sampler decides each position, so a seeded request draws the same tokens with and
    without speculation, and again on a second run."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([4, 30, 70], len(tokenizer), seed=9)]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True, n=2)
    plain = LLM(str(bigram_target), dtype="float32", kv_cache_memory_bytes=8 << 20)
    expected = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = eagle_llm(bigram_target, method, exact_eagle_heads[method], 3)
    stats = record_spec_stats(llm)
    for _ in range(2):
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    check_block_accounting(llm)


def test_target_layer_inputs_match_transformers(tiny_llama, llama_eagle_heads, tokenizer):
    """The target keeps the residual stream entering layers 0, 1, 1 (EAGLE-3's ids; 0 is the
    embeddings): transformers' ``hidden_states[i]`` of the same prompt."""
    prompt = random_prompts([23], len(tokenizer), seed=3)[0]
    llm = eagle_llm(tiny_llama, "eagle3", llama_eagle_heads["eagle3"], 2)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    aux = model_runner(llm).model.aux_hidden_states  # of the last forward: the prefill
    with torch.inference_mode():
        hf_states = hf_model(tiny_llama)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(aux) == 3
    for got, layer in zip(aux, [0, 1, 1]):
        torch.testing.assert_close(got.cpu(), hf_states[layer][0], atol=1e-4, rtol=1e-4)


def test_bad_eagle_configs_fail_at_start_up(tiny_llama, llama_eagle_heads, tmp_path):
    def engine_config(method, model, k=2):
        spec = {"method": method, "num_speculative_tokens": k, **({"model": str(model)} if model else {})}
        return EngineArgs(model=str(tiny_llama), speculative_config=spec).create_engine_config()

    with pytest.raises(ValueError, match=r"speculative_config\['model'\] \(an EAGLE head's path or Hub id\) is "
                                         r"required for method 'eagle3'"):
        engine_config("eagle3", None)
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\] must be an integer >= 1, got 0"):
        engine_config("eagle", llama_eagle_heads["eagle"], k=0)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]='/nonexistent/head'"):
        engine_config("eagle", "/nonexistent/head")
    narrow = make_eagle_head(tmp_path / "narrow", tiny_llama, "eagle", hidden_size=32)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]=.* has hidden_size 32, the target model 64"):
        engine_config("eagle", narrow)
    with pytest.raises(ValueError, match=r"is a LlamaForCausalLMEagle3 checkpoint; method 'eagle' loads"):
        engine_config("eagle", llama_eagle_heads["eagle3"])
    # vLLM's default layers (2, L // 2, L - 3) do not exist in a 2-layer target.
    default_layers = make_eagle_head(tmp_path / "default-layers", tiny_llama, "eagle3")
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[2, 1, -1\] must be 3 layer ids of the "
                                         r"target's 2 layers"):
        engine_config("eagle3", default_layers)
    config = engine_config("eagle3", llama_eagle_heads["eagle3"])
    spec = config.speculative_config
    assert spec.eagle_aux_hidden_state_layer_ids == (0, 1, 1) and spec.uses_draft_model
    assert spec.draft_model_config.architecture == "Eagle3LlamaForCausalLM"
