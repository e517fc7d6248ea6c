"""Structured outputs after the reasoning (``StructuredOutputsConfig.reasoning_parser``, vLLM's
``reasoning_ended`` gating): the grammar neither constrains nor advances while the request
reasons, and constrains every token after the reasoning's end marker.

Scheduler level, with the real manager (xgrammar, the tiny tokenizer) and scripted tokens:
no bitmask row while reasoning, rows from the token after ``</think>``, the JSON answer ends
the request; a prompt that closes the reasoning (Qwen3 with thinking off) is constrained from
the first token. Engine level (``LLM``, greedy): a prompt left inside ``<think>`` generates
exactly the unconstrained output; one that closes it generates JSON valid by the schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, StructuredOutputsConfig
from pagedllm.messages.engine_core import EngineCoreRequest, FinishReason
from pagedllm.messages.runner_output import ModelRunnerOutput
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer
from tests.core.test_scheduler import make_scheduler
from tests.helpers import check_block_accounting

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
REASONING = "no {json here"
ANSWER = '{"a": 1}'


@pytest.fixture(scope="module")
def model_config(tiny_llama):
    return EngineArgs(model=str(tiny_llama), dtype="float32").create_engine_config().model_config


def _run_scripted(model_config, prompt: str, output: str, **config):
    """Feed ``output``'s tokens (then EOS) as the sampled ones of one constrained request;
    returns (the number of tokens sampled before the first bitmask row, the finish reason,
    whether the request finished on the script's last token). A bitmask row that refuses the
    scripted token fails with "the grammar refuses ..."."""
    tokenizer = get_tokenizer(model_config.tokenizer_path)
    scheduler = make_scheduler()
    scheduler.structured_output_manager = StructuredOutputManager(StructuredOutputsConfig(**config), model_config)
    params = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    scheduler.add_request(EngineCoreRequest("r", prompt_ids, params, tokenizer.eos_token_id, 0.0))
    scheduler.requests["r"].structured_output_request.future.result()  # compiled
    script = tokenizer.encode(output, add_special_tokens=False) + [tokenizer.eos_token_id]
    first_row = None
    for step, token in enumerate(script):
        out = scheduler.schedule()
        if "r" in out.structured_output_request_ids:
            first_row = step if first_row is None else first_row
            row = out.grammar_bitmask[out.structured_output_request_ids["r"]]
            assert (row[token // 32] >> (token % 32)) & 1, f"the grammar refuses {tokenizer.decode([token])!r}"
        runner_output = ModelRunnerOutput(["r"], {"r": 0}, [[token]])
        (engine_output,) = scheduler.update_from_output(out, runner_output).outputs
        if engine_output.finish_reason is not None:
            return first_row, engine_output.finish_reason, step == len(script) - 1
    raise AssertionError("the request did not finish")


def test_grammar_starts_after_the_reasoning(model_config):
    tokenizer = get_tokenizer(model_config.tokenizer_path)
    num_reasoning = len(tokenizer.encode(REASONING + "</think>", add_special_tokens=False))
    gated = _run_scripted(model_config, "Hi<think>\n", REASONING + "</think>" + ANSWER, reasoning_parser="deepseek_r1")
    assert gated == (num_reasoning, FinishReason.STOP, True)
    # a prompt that closes the reasoning (Qwen3's template with thinking off): constrained at once
    closed = _run_scripted(model_config, "Hi<think>\n\n</think>\n\n", ANSWER, reasoning_parser="qwen3")
    assert closed == (0, FinishReason.STOP, True)
    # no reasoning parser, or enable_in_reasoning: the grammar refuses the reasoning's first token
    for config in ({}, {"reasoning_parser": "deepseek_r1", "enable_in_reasoning": True}):
        with pytest.raises(AssertionError, match="the grammar refuses 'n"):
            _run_scripted(model_config, "Hi<think>\n", REASONING + "</think>" + ANSWER, **config)


def test_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        StructuredOutputsConfig(reasoning_parser="nope")


def test_llm_reasons_freely_then_answers_by_the_schema(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20,
              structured_outputs_config={"reasoning_parser": "deepseek_r1"})  # fmt: skip
    constrained = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    free = SamplingParams(temperature=0.0, max_tokens=48)
    thinking, answering, reference = llm.generate(
        ["Hi<think>\n", "Hi<think>\nok</think>\n", "Hi<think>\n"], [constrained, constrained, free], use_tqdm=False
    )
    assert not reference.outputs[0].text.lstrip().startswith("{")  # the schema would not allow it
    assert thinking.outputs[0].token_ids == reference.outputs[0].token_ids  # the reasoning is unconstrained
    assert answering.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answering.outputs[0].text), SCHEMA)
    check_block_accounting(llm)


def test_parsers_say_where_the_reasoning_ends():
    from pagedllm.reasoning import ReasoningParserManager

    r1 = ReasoningParserManager.get_reasoning_parser("deepseek_r1")()
    assert [r1.is_reasoning_end(t) for t in ("<think>\n", "a</think>", "x</think>\n<think>", "plain")] == [
        False, True, False, False,
    ]  # fmt: skip
    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")
    assert not qwen3().is_reasoning_end("<think>\nhm") and qwen3({"enable_thinking": False}).is_reasoning_end("")
    gpt_oss = ReasoningParserManager.get_reasoning_parser("gpt_oss")()
    assert not gpt_oss.is_reasoning_end("<|channel|>analysis<|message|>think")
    assert gpt_oss.is_reasoning_end("<|end|><|start|>assistant<|channel|>final<|message|>")
    assert not gpt_oss.is_reasoning_end("<|start|>assistant<|channel|>final")  # the header is not complete


def test_serve_hands_its_reasoning_parser_to_the_engine():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.openai.cli_args import engine_args_from

    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert engine_args_from(args).structured_outputs_config == {"reasoning_parser": "qwen3"}
    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3", "--structured-outputs-config",
                                      '{"backend": "guidance", "reasoning_parser": "deepseek_r1"}'])  # fmt: skip
    assert engine_args_from(args).structured_outputs_config == {"backend": "guidance", "reasoning_parser": "deepseek_r1"}
    assert engine_args_from(build_parser().parse_args(["serve"])).structured_outputs_config is None
