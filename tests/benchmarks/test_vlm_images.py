"""``benchmarks/vlm_images.py`` on the tiny Qwen2.5-VL (``make_checkpoint``'s ``qwen2.5-vl-tiny``,
written by the script itself) with 2 requests, timed in bfloat16 as the real run: it exits 0,
pagedllm's greedy tokens equal transformers' in the float32 check, and its table has every row,
with numbers that agree with each other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("throughput, requests/s", "throughput, output tokens/s", "TTFT batch 1, cold image, s",
           "TTFT batch 1, the same image and text again, s", "encoder share of the cold batch-1 prefill step",
           "encoder share of the throughput rounds' steps")


def _number(cell: str) -> float:
    return float(re.match(r"[0-9.]+", cell).group())


def test_vlm_images_table(tmp_path):
    command = [sys.executable, "benchmarks/vlm_images.py", "--model", str(tmp_path / "qwen2.5-vl-tiny"),
               "--preset", "qwen2.5-vl-tiny", "--num-requests", "2", "--image-size", "64",
               "--output-len", "6", "--rounds", "1", "--ttft-rounds", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "first request greedy tokens equal in float32: True (6 of 6 tokens" in out  # fresh float32 sides
    assert re.search(r"^in bfloat16 \(the timed runs\): \d of 6 tokens equal", out, re.M)
    # A 64 x 64 image is 4 x 4 merged patches of 16 pixels: 16 placeholders between the two markers.
    assert "2 requests of one 64x64 image + 64 text tokens (82 prompt tokens), 6 tokens out" in out
    assert re.search(r"^machine: .*ISA \w+; torch threads \d+; load average [0-9.]+ before, [0-9.]+ after$", out, re.M)
    rows = {cells[0]: cells[1:] for line in out.splitlines() if line.startswith("| ") and "---" not in line
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    assert rows.pop("metric") == ["pagedllm", "transformers", "pagedllm / transformers"]
    assert tuple(rows) == METRICS
    for metric in METRICS[:3]:  # the ratio is of the unrounded values: within the cells' rounding
        (ours, theirs, ratio), half = map(_number, rows[metric]), 0.05 if "tokens" in metric else 0.0005
        assert ours > 0 and theirs > half, (metric, rows[metric])
        assert (ours - half) / (theirs + half) - 0.005 <= ratio <= (ours + half) / (theirs - half) + 0.005, rows[metric]
    assert abs(_number(rows[METRICS[1]][0]) - 6 * _number(rows[METRICS[0]][0])) < 0.1  # 6 tokens per request
    warm, cold = re.fullmatch(r"([0-9.]+) \(cold ([0-9.]+)\)", rows[METRICS[3]][0]).groups()
    assert cold == rows[METRICS[2]][0] and float(warm) > 0
    for metric in METRICS[4:]:
        assert 0 < _number(rows[metric][0]) <= 100 and rows[metric][0].endswith("%")
