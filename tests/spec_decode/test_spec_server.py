"""`pagedllm serve --speculative-config`: completions through the official client, the
spec_decode counters in /metrics, and a bad config refused at start-up naming the key."""

from __future__ import annotations

import subprocess
import sys

from pagedllm import LLM, SamplingParams
from tests.server_utils import RemoteServer
from tests.spec_decode.test_spec_greedy_equality import REPEAT_PASSAGE

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def test_serve_with_ngram_speculation_reports_acceptance():
    """The server's greedy text equals the single-process engine's without speculation
    (the shipped model, float32 as ``RemoteServer``)."""
    prompt = REPEAT_PASSAGE + "\n\n" + REPEAT_PASSAGE[:60]
    plain = LLM(dtype="float32", kv_cache_memory_bytes=16 << 20)
    (want,) = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    del plain
    server = RemoteServer(None, "--speculative-config", NGRAM)
    try:
        client = server.client()
        got = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=48,
                                        temperature=0)
        assert got.choices[0].text == want.outputs[0].text
        metrics = server.metrics()
        drafts = metrics["pagedllm:spec_decode_num_drafts_total"]
        accepted = metrics["pagedllm:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < accepted <= metrics["pagedllm:spec_decode_num_draft_tokens_total"]
        assert sum(metrics[f"pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
                   for i in range(4)) == accepted
    finally:
        server.close()


def test_serve_refuses_a_bad_config_naming_the_key():
    run = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 0}'], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "speculative_config['num_speculative_tokens'] must be an integer >= 1, got 0." in run.stderr
