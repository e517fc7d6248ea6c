"""``pagedllm run-batch``: OpenAI batch lines in, one response line each out (in order),
through the server's endpoints; a bad line gets its own error and the batch goes on."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import hf_greedy


def test_run_batch_answers_every_line_in_order(tiny_llama, tokenizer, tmp_path):
    prompt = [5, 17, 99, 250, 31]
    completion = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": completion},
        "not json",
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/nothing", "body": completion},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/completions", "body": {**completion, "max_tokens": -1}},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(source), "-o", str(target),
         str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory-bytes", "16M",
         "--max-model-len", "512"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Running batch" in result.stderr  # the progress bar
    outputs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["c1", None, "bad-url", "chat", "bad-body"]
    assert [o["response"]["status_code"] for o in outputs] == [200, 400, 400, 200, 400]
    first = outputs[0]["response"]["body"]
    assert first["object"] == "text_completion" and outputs[0]["error"] is None
    assert first["choices"][0]["text"] == tokenizer.decode(hf_greedy(tiny_llama, prompt, 6), skip_special_tokens=True)
    assert outputs[3]["response"]["body"]["object"] == "chat.completion"
    assert "not valid JSON" in outputs[1]["error"] and "/v1/nothing" in outputs[2]["error"]
    assert outputs[4]["response"]["body"]["error"]["param"] == "max_tokens" and outputs[4]["error"]
    assert all(o["id"].startswith("pagedllm-") and o["response"]["request_id"] for o in outputs)
