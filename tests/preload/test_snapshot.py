"""``pagedllm snapshot`` (``pagedllm.snapshot.snapshots``): a snapshot keeps the serve flags, a
copy of each LoRA adapter and the loaded weights; what ``restore`` starts maps those weights
and gives transformers' greedy tokens."""

from __future__ import annotations

import argparse
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser
from pagedllm.snapshot import snapshots
from tests.helpers import check_block_accounting, hf_greedy

PROMPT = [4, 8, 15, 16, 23, 42]


def test_restore_serves_the_snapshot(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    flags = [str(tiny_llama), "--dtype", "float32", "--max-model-len", "64", "--enable-lora", "--lora-modules", f"ad={adapter}"]
    directory = snapshots.create("tiny", flags)
    shutil.rmtree(adapter)  # the snapshot has its own copy
    with pytest.raises(ValueError, match="exists"):
        snapshots.create("tiny", flags)
    assert [s["name"] for s in snapshots.list_snapshots()] == ["tiny"]
    argv, env = snapshots.restore_command("tiny")
    assert argv[:2] == ["serve", str(tiny_llama)] and argv[-2:] == ["--lora-modules", f"ad={directory / 'adapters/ad'}"]
    assert (directory / "adapters/ad/adapter_config.json").exists()
    parser = argparse.ArgumentParser()
    make_arg_parser(parser)
    args = parser.parse_args(argv[1:-2])  # what `restore` serves, its adapter aside
    args.model = args.model_tag
    engine_args = engine_args_from(args)
    assert engine_args.load_format == "ipc_cache"
    monkeypatch.setenv("PAGEDLLM_PRELOAD_DIR", env["PAGEDLLM_PRELOAD_DIR"])
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "usage_context"}
    llm = LLM(**{**kwargs, "num_gpu_blocks_override": 16})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids == hf_greedy(tiny_llama, PROMPT, 8)
    check_block_accounting(llm)
    snapshots.delete("tiny")
    assert snapshots.list_snapshots() == []
    with pytest.raises(ValueError, match="No snapshot 'tiny'"):
        snapshots.restore_command("tiny")
