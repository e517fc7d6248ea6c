"""``pagedllm serve --calculate-kv-cache-size``: prints the KV cache the flags give (bytes,
tokens, blocks; per KV-cache group) and exits 0 without serving."""

from __future__ import annotations

import json
import subprocess
import sys


def test_calculate_kv_cache_size_prints_the_sizes_and_exits(tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # K and V x block of 16 tokens x layers x KV heads x head size x 4 bytes (float32)
    per_block = 2 * 16 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    num_blocks = (1 << 20) // per_block
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama), "--dtype", "float32",
         "--kv-cache-memory-bytes", "1M", "--max-model-len", "256", "--calculate-kv-cache-size"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == (f"KV cache: {num_blocks * per_block} bytes, {num_blocks * 16} tokens, {num_blocks} blocks "
                        f"of 16 tokens ({per_block} bytes per block, float32)")
    assert lines[1] == (f"KV cache group 0 (full attention, {config['num_hidden_layers']} layers): "
                        f"{num_blocks * per_block} bytes, {num_blocks * 16} tokens, {num_blocks} blocks")
