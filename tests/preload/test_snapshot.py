"""``pagedllm snapshot`` (``pagedllm.snapshot.snapshots``): a snapshot keeps the serve flags, a
copy of each LoRA adapter and the loaded weights; what ``restore`` starts maps those weights
and gives transformers' greedy tokens. ``snapshot create NAME --url URL`` of a running server
(an adapter loaded at run time, two API keys) restores to a server with its greedy outputs
and its /v1/models, which never reported its keys."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main as pagedllm_main
from pagedllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser
from pagedllm.snapshot import snapshots
from tests.helpers import check_block_accounting, hf_greedy, make_peft_adapter
from tests.server_utils import RemoteServer, idle_kv_cache_usage

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
    argv, env, cwd = snapshots.restore_command("tiny")
    module = {"name": "ad", "path": str(directory / "adapters/ad"), "base_model_name": None}
    assert argv[:2] == ["serve", str(tiny_llama)] and argv[-2:] == ["--lora-modules", json.dumps(module)]
    assert cwd == os.getcwd()
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


API_KEY, OTHER_API_KEY = "sk-snapshot", "sk-snapshot-other"
MAX_TOKENS = 8


def _greedy(server: RemoteServer, model: str) -> list[str]:
    reply = server.client().completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                               logprobs=1)
    return reply.choices[0].logprobs.tokens


def _cards(server: RemoteServer) -> list[tuple]:
    return [(c.id, c.parent, c.max_model_len, c.root) for c in server.client().models.list().data]


def test_snapshot_of_a_running_server_by_url(tiny_llama, tmp_path, monkeypatch):
    adapter, _ = make_peft_adapter(tiny_llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                   seed=3)
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 128\nmax-lora-rank: 8\n")
    monkeypatch.setenv("PAGEDLLM_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    env = dict(os.environ, PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    original = RemoteServer(tiny_llama, "--served-model-name", "tiny", "--enable-lora", "--config", str(config),
                            api_key=API_KEY, other_api_keys=(OTHER_API_KEY,), env=env)
    try:
        body = {"lora_name": "late", "lora_path": str(adapter)}
        assert original.post("/v1/load_lora_adapter", json=body).status_code == 200
        info = original.get("/server_info").json()
        expected = {model: _greedy(original, model) for model in ("tiny", "late")}
        cards = _cards(original)
        with pytest.raises(ValueError, match="needs its API key"):
            snapshots.create_from_url("live", original.url)
        assert pagedllm_main(["snapshot", "create", "live", "--url", original.url, "--api-key", OTHER_API_KEY]) == 0
        directory = snapshots.snapshot_dir("live")
    finally:
        original.close()
    assert API_KEY not in json.dumps(info) and OTHER_API_KEY not in json.dumps(info) and info["api_key"]
    assert "--config" not in info["serve_args"] and info["lora_modules"][0]["name"] == "late"
    assert expected["late"] != expected["tiny"]  # the adapter changes the output
    shutil.rmtree(adapter)
    config.unlink()  # the snapshot needs neither: its own copy of the adapter, the file's flags inlined
    restored = RemoteServer(None, command=("snapshot", "restore", "live"), env=env)
    try:
        restored.api_key = OTHER_API_KEY  # the key the snapshot was made with is the restored server's
        assert restored.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        assert {model: _greedy(restored, model) for model in ("tiny", "late")} == expected
        restored_cards = _cards(restored)
        assert [card[:3] for card in restored_cards] == [card[:3] for card in cards]
        assert restored_cards[0][3] == cards[0][3] and restored_cards[1][3] == str(directory / "adapters/late")
        assert "Mapped the preloaded weights" in restored.log_text()
        assert idle_kv_cache_usage(restored) == 0.0
    finally:
        restored.close()
