"""``pagedllm bench perplexity``: the windows and scored tokens follow llama-perplexity's rule,
and the perplexity equals exp(mean NLL) computed with transformers on the same windows."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from pagedllm.benchmarks import cli as bench_cli
from pagedllm.benchmarks.perplexity import make_windows, summarize_nll
from pagedllm.model_paths import default_model_path

MODEL_DIR = default_model_path()


def _text() -> str:
    """Prose the shipped model can score: its own model card (about 1,500 tokens)."""
    return (MODEL_DIR / "README.md").read_text(encoding="utf-8")


def _hf_nlls(ids: list[list[int]], first_scored: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor(ids)).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(ids)[:, first_scored:]
    picked = logprobs[:, first_scored - 1:-1].gather(2, targets[..., None]).squeeze(2)
    return (-picked).flatten().tolist()


def test_windows_follow_llama_perplexity():
    ids = list(range(10, 31))  # 21 tokens: two whole windows of 8, the tail dropped
    halves = make_windows(ids, 8, "second-half", bos_token_id=None)
    assert halves.token_ids == [ids[0:8], ids[8:16]] and halves.first_scored == 5  # tokens 5, 6, 7
    with_bos = make_windows(ids, 8, "second-half", bos_token_id=1, num_chunks=1)
    assert with_bos.token_ids == [[1, *ids[1:8]]]
    every = make_windows(ids, 8, "all", bos_token_id=1)
    assert every.first_scored == 1 and every.token_ids[1] == ids[8:16]  # no BOS replacement
    with pytest.raises(ValueError, match="has 21 tokens; a context of 16 needs at least 32"):
        make_windows(ids, 16, "all", None)
    with pytest.raises(ValueError, match="at least 4"):
        make_windows(ids, 2, "all", None)


def test_summary_matches_llama_perplexity_formula():
    r = summarize_nll([1.0, 2.0, 3.0])
    assert r["perplexity"] == pytest.approx(math.e ** 2)
    assert r["perplexity_error"] == pytest.approx(math.e ** 2 * math.sqrt((14 / 3 - 4) / 2))
    assert r["num_scored_tokens"] == 3


@pytest.mark.parametrize("rule", ["second-half", "all"])
def test_perplexity_equals_transformers_on_the_same_windows(rule, tmp_path, capsys):
    from transformers import AutoTokenizer

    text_file = tmp_path / "text.txt"
    text_file.write_text(_text(), encoding="utf-8")
    out = tmp_path / "ppl.json"
    parser = argparse.ArgumentParser(prog="pagedllm")
    bench_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "perplexity", "--dataset-path", str(text_file), "--context-size", "64",
                              "--num-chunks", "6", "--scored-tokens", rule, "--dtype", "float32",
                              "--kv-cache-memory-bytes", str(8 << 20), "--output-json", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert "perplexity:" in capsys.readouterr().out

    ids = AutoTokenizer.from_pretrained(MODEL_DIR)(_text())["input_ids"]
    windows = make_windows(ids, 64, rule, bos_token_id=None, num_chunks=6)
    expected = summarize_nll(_hf_nlls(windows.token_ids, windows.first_scored))
    assert result["num_chunks"] == 6 and result["num_scored_tokens"] == expected["num_scored_tokens"]
    assert result["num_scored_tokens"] == 6 * (31 if rule == "second-half" else 63)
    assert result["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-4)
    assert 5 < result["perplexity"] < 1000  # a trained model on English prose
