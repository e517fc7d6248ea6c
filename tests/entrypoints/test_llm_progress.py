"""Offline ``LLM``: the progress bar shows input and output tokens/s as vLLM's; the stats line
is off by default (``disable_log_stats=True``, as vLLM's ``LLM``) and on when asked."""

from __future__ import annotations

import logging
import re

import pytest

from pagedllm import LLM, SamplingParams

KV_BYTES = 8 << 20
SPEED_RE = re.compile(r"Processed prompts: 100%.*est\. speed input: (\d+\.\d\d) toks/s, output: (\d+\.\d\d) toks/s")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=256)


def test_progress_bar_shows_token_speeds(llm, capsys):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = llm.generate(["one two three", "four five"], params, use_tqdm=True)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    speeds = SPEED_RE.findall(capsys.readouterr().err)
    assert speeds, "no speed on the progress bar"
    input_speed, output_speed = map(float, speeds[-1])
    assert input_speed > 0 and output_speed > 0
    # both over the same elapsed time: their ratio is the token counts' (up to rounding)
    num_input = sum(len(o.prompt_token_ids) for o in outputs)
    assert output_speed / input_speed == pytest.approx(16 / num_input, rel=0.02)


def test_no_bar_without_tqdm(llm, capsys):
    llm.generate("quiet", SamplingParams(max_tokens=2), use_tqdm=False)
    assert "est. speed" not in capsys.readouterr().err


def test_stats_line_offline(tiny_llama, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", "0.000001")
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    quiet = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=256)
    quiet.generate("a b", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert not [r for r in caplog.records if "Avg generation throughput" in r.getMessage()]
    logged = LLM(
        str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=256, disable_log_stats=False
    )
    logged.generate("a b", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage()]
    assert lines and any("Running: 1 reqs" in line for line in lines)
