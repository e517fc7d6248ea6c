"""Rope scalings served past the original context, greedy token-identical to transformers
float32: YaRN from config.json and turned on by ``--hf-overrides`` on a checkpoint without it
(the default ``max_model_len`` follows the scaling), dynamic NTK and LongRoPE; the
``--hf-overrides`` flag and its merge into the HF config."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Gemma3Config, LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.config.hub import apply_hf_overrides
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import engine_args_from
from tests.helpers import check_block_accounting, hf_model, random_prompts

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
#: Qwen2 of 64 positions; YaRN x4 serves 256 (vLLM's rule: original x factor).
QWEN2 = {"seed": 1, "tie_word_embeddings": True, "max_position_embeddings": 64}
HALF = 8  # head_dim 16 / 2: LongRoPE's factors per channel
LONGROPE = {
    "rope_type": "longrope", "original_max_position_embeddings": 32,
    "short_factor": [1.0 + 0.05 * i for i in range(HALF)], "long_factor": [1.5 + 0.5 * i for i in range(HALF)],
}  # fmt: skip


def _hf_decode(path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, one forward per decode step over its KV cache (what its
    ``generate`` runs; written out so that EOS stays a candidate, as under ``ignore_eos``)."""
    model = hf_model(path)
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), cache=out.past_key_values, use_cache=True)
    return tokens


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_block_accounting(llm)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def yarn_reference(checkpoint_factory, tokenizer):
    """The YaRN checkpoint, prompts (one longer than the original 64 positions) and
    transformers' greedy tokens, generated to position 109."""
    path = checkpoint_factory("Qwen2ForCausalLM", rope_scaling=YARN, **QWEN2)
    prompts = random_prompts([30, 70], len(tokenizer), seed=3)
    return path, prompts, [_hf_decode(path, p, 40) for p in prompts]


def test_yarn_checkpoint_past_the_original_context(yarn_reference):
    path, prompts, expected = yarn_reference
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.model_config.max_model_len == 256
    assert _generate(llm, prompts, 40) == expected


def test_hf_overrides_turn_on_yarn(yarn_reference, checkpoint_factory):
    plain = checkpoint_factory("Qwen2ForCausalLM", **QWEN2)  # the same weights, no rope scaling
    assert EngineArgs(model=str(plain)).create_engine_config().model_config.max_model_len == 64
    _, prompts, expected = yarn_reference
    llm = LLM(str(plain), dtype="float32", kv_cache_memory_bytes=16 << 20, hf_overrides={"rope_scaling": YARN},
              max_model_len=200)  # fmt: skip
    assert llm.llm_engine.model_config.hf_overrides == {"rope_scaling": YARN}
    assert llm.llm_engine.model_config.hf_config.rope_parameters["rope_theta"] == 10000.0
    assert _generate(llm, prompts, 40) == expected


@pytest.mark.parametrize(
    ("rope_scaling", "max_position_embeddings", "max_model_len"),
    [({"rope_type": "dynamic", "factor": 2.0}, 64, 128), (LONGROPE, 128, 128)],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_ropes_match_transformers_decode(checkpoint_factory, tokenizer, rope_scaling,
                                                           max_position_embeddings, max_model_len):  # fmt: skip
    """Prompts within the original length, generated past it: transformers switches to the
    grown base (dynamic) or the long factors (LongRoPE) at the decode steps beyond it."""
    path = checkpoint_factory("LlamaForCausalLM", seed=6, rope_scaling=rope_scaling,
                              max_position_embeddings=max_position_embeddings)  # fmt: skip
    prompts = random_prompts([30], len(tokenizer), seed=5)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.model_config.max_model_len == max_model_len
    assert _generate(llm, prompts, 45) == [_hf_decode(path, p, 45) for p in prompts]


def test_hf_overrides_flag_parses_json(capsys):
    args = build_parser().parse_args(["serve", "--hf-overrides", '{"rope_parameters": {"rope_type": "yarn"}}'])
    assert engine_args_from(args).hf_overrides == {"rope_parameters": {"rope_type": "yarn"}}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hf-overrides", "[1]"])
    assert "--hf-overrides: invalid value '[1]': expected a JSON object" in capsys.readouterr().err


def test_hf_overrides_merge_nested_values():
    config = LlamaConfig(rope_theta=5e5, max_position_embeddings=128)
    apply_hf_overrides(config, {"rope_parameters": {"type": "yarn", "factor": 2.0}, "max_position_embeddings": 256})
    assert config.max_position_embeddings == 256
    assert config.rope_parameters == {"rope_theta": 5e5, "rope_type": "yarn", "type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings": 256}  # fmt: skip
    apply_hf_overrides(config, {"rope_theta": 1e6, "rope_scaling": None})  # 4.x keys, into rope_parameters
    assert (config.rope_parameters["rope_theta"], config.rope_parameters["rope_type"]) == (1e6, "default")
    gemma3 = Gemma3Config(text_config={"num_hidden_layers": 2})
    apply_hf_overrides(gemma3, {"text_config": {"num_hidden_layers": 3}})  # a sub-config, merged
    assert gemma3.text_config.num_hidden_layers == 3 and gemma3.text_config.hidden_size == Gemma3Config().text_config.hidden_size
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        apply_hf_overrides(AutoConfig.for_model("llama"), ["rope_theta"])
