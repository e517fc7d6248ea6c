"""``speculative_config`` (vLLM's keys): accepted forms, defaults, and start-up errors that
name the key; the scheduler's 1 + k token steps; the n-gram proposer; the metrics."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pagedllm import LLM
from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.messages.engine_core import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.spec_decode import NgramProposer
from tests.fixtures.checkpoints import make_checkpoint


def test_forms_and_defaults():
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 5, 5)
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    draft = SpeculativeConfig.from_dict({"model": "some/draft", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.uses_draft_model and draft.model == "some/draft"
    assert (draft.enable_adaptive_k, draft.adaptive_k_ema_alpha) == (True, 0.3)
    fixed = SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 2, "enable_adaptive_k": False,
                                         "adaptive_k_ema_alpha": 1})
    assert (fixed.enable_adaptive_k, fixed.adaptive_k_ema_alpha) == (False, 1.0)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "ngram"}, "speculative_config['num_speculative_tokens'] must be an integer >= 1, got None."),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config['num_speculative_tokens'] must be"),
        ({"method": "medusa2", "num_speculative_tokens": 2}, "speculative_config['method'] must be one of"),
        ({"num_speculative_tokens": 2}, "speculative_config['method'] must be one of"),
        ({"method": "medusa", "model": "x", "num_speculative_tokens": 2},
         "speculative_config['method']='medusa' is not supported yet"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config['model']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative_config['prompt_lookup_min'] (4) must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config['prompt_lookup_min']"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "speculative_config['lookahead'] is not a known key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "enable_adaptive_k": "yes"},
         "speculative_config['enable_adaptive_k'] must be true or false, got 'yes'."),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_k_ema_alpha": 0},
         "speculative_config['adaptive_k_ema_alpha'] must be a number in (0, 1], got 0."),
    ],
)
def test_bad_configs_fail_when_the_arguments_are_built(config, message):
    with pytest.raises(ValueError) as e:
        EngineArgs(speculative_config=config)
    assert message in str(e.value)


def test_draft_model_errors_name_the_key(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]='/nonexistent/draft'"):
        EngineArgs(model=str(tiny_llama), speculative_config={"model": "/nonexistent/draft", "num_speculative_tokens": 2}
                   ).create_engine_config()
    other_vocab = make_checkpoint(tmp_path / "other-vocab", "LlamaForCausalLM", vocab_size=512, tokenizer_vocab_size=512)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]=.* has a vocabulary of 512 tokens"):
        EngineArgs(model=str(tiny_llama), speculative_config={"model": str(other_vocab), "num_speculative_tokens": 2}
                   ).create_engine_config()


def test_ngram_proposer():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # Suffix [7, 8] occurs at 1 (earliest) and 5: the tokens after the first occurrence.
    assert proposer.propose_one(np.array([1, 7, 8, 9, 4, 7, 8, 5, 7, 8]), 3) == [9, 4, 7]
    assert proposer.propose_one(np.array([1, 7, 8, 9, 4, 7, 8, 5, 7, 8]), 1) == [9]
    # The longest match wins: [3, 7, 8] beats the earlier [7, 8].
    assert proposer.propose_one(np.array([7, 8, 1, 3, 7, 8, 6, 3, 7, 8]), 3) == [6, 3, 7]
    assert proposer.propose_one(np.array([1, 2, 3, 4]), 3) == []  # nothing recurs
    assert proposer.propose_one(np.array([5, 6, 5]), 3) == [6, 5]  # fewer than k tokens follow
    assert NgramProposer(2, 3).propose_one(np.array([1, 2, 9, 2]), 3) == []  # a 1-token match is too short
    rows = np.array([1, 0])
    token_ids = np.array([[4, 4, 0, 0], [1, 2, 1, 0]])
    assert proposer.propose(rows, np.array([3, 3]), token_ids, np.array([2, 3]), np.zeros((2, 1)),
                            np.zeros(2)) == ([[2, 1], [4]], {})



def _ngram_reference(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """vLLM's rule by brute force: the longest suffix (min_n .. max_n tokens) that occurs
    earlier, its earliest occurrence, the tokens after it."""
    last = len(tokens) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        for start in range(last - n + 1):
            if tokens[start : start + n] == tokens[last + 1 - n :]:
                return tokens[start + n : start + n + max_tokens]
    return []


def test_ngram_proposer_matches_reference_and_whole_tokens():
    """The byte search finds what the brute-force rule finds, on token ids of several
    bytes too, and never a match that straddles tokens."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40)))
        if rng.random() < 0.5:
            tokens = tokens * 65793 + 257  # ids of 3 nonzero bytes
        for min_n, max_n in ((1, 1), (1, 3), (2, 4), (3, 5)):
            got = NgramProposer(min_n, max_n).propose_one(tokens, 4)
            assert got == _ngram_reference(tokens.tolist(), 4, min_n, max_n)
    assert NgramProposer(2, 2).propose_one(np.array([1, 256, 1, 9, 256, 1]), 2) == [9, 256]
    # The suffix [1, 1]'s bytes (01 00 x 7, 01 00 x 7) occur one byte into [256, 256, 512]'s
    # (00 01 00 x 6, 00 01 00 x 6, 00 02 ..): not a token match, so nothing is proposed.
    assert NgramProposer(2, 2).propose_one(np.array([256, 256, 512, 9, 1, 1]), 2) == []

def test_scheduler_budgets_drafts_and_rolls_back_rejected(tiny_llama, tokenizer):
    """A request brings its drafts into the next step (1 + k tokens, lookahead reserved for a
    draft model); rejected ones are taken off num_computed_tokens."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
              speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 3})
    core = llm.llm_engine.engine_core
    from pagedllm import SamplingParams

    llm.llm_engine.add_request("r", {"prompt_token_ids": list(range(3, 13))},
                               SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    first = core.scheduler.schedule()
    assert first.num_scheduled_tokens == {"r": 10} and not first.scheduled_spec_decode_tokens
    # 10 prompt tokens + 3 lookahead slots: 2 blocks of 8.
    assert len(core.kv_cache_manager.get_block_ids("r")[0]) == 2
    core.scheduler.update_from_output(first, core.model_executor.execute_model(first))
    request = core.scheduler.requests["r"]
    assert len(request.spec_token_ids) == 3 and request.num_computed_tokens == 10
    second = core.scheduler.schedule()
    assert second.num_scheduled_tokens == {"r": 4}
    assert second.scheduled_spec_decode_tokens == {"r": request.spec_token_ids}
    output = core.model_executor.execute_model(second)
    assert len(output.sampled_token_ids[0]) == 4  # the draft is the target: all accepted
    core.scheduler.update_from_output(second, output)
    assert request.num_output_tokens == 5 and request.num_computed_tokens == 14
    # One token left to max_tokens: no draft (the step's own token is the last one).
    assert request.spec_token_ids == []


def test_metrics_and_log_line(tiny_llama):
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 2)
    stats.observe_draft(3, 0)
    scheduler_stats = SchedulerStats(spec_decoding_stats=stats)
    logger = LoggingStatLogger()
    logger.record(scheduler_stats, None)
    assert logger.log().endswith(", Spec decode acceptance rate: 33.3%, Mean acceptance length: 2.00")
    assert "Spec decode" not in logger.log()  # nothing verified in the next interval

    config = EngineArgs(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 3}
                        ).create_engine_config()
    registry = CollectorRegistry()
    PrometheusStatLogger(registry, "m", config).record(scheduler_stats, None)
    text = generate_latest(registry).decode()
    assert 'pagedllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 6.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 2.0' in text
    for position, value in enumerate([1.0, 1.0, 0.0]):
        assert (f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{position}"}} '
                f"{value}") in text


def test_bench_latency_with_ngram_on_the_repeat_dataset(tmp_path, capsys):
    """`bench latency --dataset-name repeat --speculative-config ...` on the shipped model."""
    import json

    from pagedllm.benchmarks.cli import main

    out = tmp_path / "latency.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    rc = main(["latency", "--dataset-name", "repeat", "--batch-size", "2", "--input-len", "64", "--output-len", "16",
               "--num-iters", "1", "--num-iters-warmup", "0", "--kv-cache-memory-bytes", str(16 << 20),
               "--speculative-config", spec, "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["dataset_name"] == "repeat" and r["engine_args"]["speculative_config"] == json.loads(spec)
    assert r["num_decode_steps"] <= 15 and r["decode_tokens_per_s"] > 0
    assert "repeat dataset" in capsys.readouterr().out



def test_spec_decode_bench_cpu_time_and_pooled_ratio(tmp_path):
    """benchmarks/spec_decode_bench.py on the shipped model: per-round ratios, their median,
    the pooled ratio (all plain decode time over all spec decode time) and, with --cpu-time,
    steps timed by CPU time."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_decode_bench.py"
    module_spec = importlib.util.spec_from_file_location("spec_decode_bench", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert bench.main(["--dataset-name", "repeat", "--batch-sizes", "1", "--input-len", "64", "--output-len", "12",
                       "--rounds", "2", "--num-iters-warmup", "0", "--kv-cache-memory-bytes", str(16 << 20),
                       "--cpu-time", "--speculative-config", spec, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cpu_time"] is True
    summary = r["batch_sizes"]["1"]
    rounds = summary["rounds"]
    assert len(rounds) == 2 and all(row["ratio"] > 0 for row in rounds)
    plain = sum(1 / row["plain"]["decode_tokens_per_s"] for row in rounds)
    assert summary["pooled_ratio"] == pytest.approx(plain / sum(1 / row["spec"]["decode_tokens_per_s"] for row in rounds))
    assert summary["median_ratio"] == pytest.approx(sum(row["ratio"] for row in rounds) / 2)

def test_repeat_dataset_prompts_repeat_their_start(tokenizer):
    from pagedllm.benchmarks.datasets import REPEAT_CUE_TOKENS, repeat_dataset

    requests = repeat_dataset(tokenizer, 3, 100, 20, seed=1)
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 3
    for r in requests:
        ids = r.prompt_token_ids
        assert len(ids) == 100 and r.expected_output_len == 20
        assert ids[-REPEAT_CUE_TOKENS:] == ids[:REPEAT_CUE_TOKENS]


def test_readme_example_runs():
    """The README's speculative-decoding example, as written."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "speculative_config" in b)
    run = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()
