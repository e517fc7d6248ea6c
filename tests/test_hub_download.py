"""Models by Hub id are downloaded as vLLM does (``huggingface_hub.snapshot_download``),
tested against a local stand-in hub reached through ``HF_ENDPOINT``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import hf_greedy
from tests.hub_server import StandInHub

RESOLVE = "import sys; from pagedllm.config import resolve_model_path as r; print(r(*sys.argv[1:]))"


def _run(code: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture()
def hub_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    return env


@pytest.fixture()
def repo_dir(tiny_llama, tmp_path):
    """The tiny checkpoint plus files a download must skip."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_llama, repo)
    (repo / "pytorch_model.bin").write_bytes(b"not needed")
    (repo / "images").mkdir()
    (repo / "images" / "logo.png").write_bytes(b"not needed")
    return repo


def test_download_by_hub_id_then_generate(repo_dir, hub_env, tiny_llama):
    with StandInHub({"acme/tiny": {"main": repo_dir}}, token="secret") as hub:
        env = {**hub_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "secret"}
        code = (
            "from pagedllm import LLM, SamplingParams\n"
            "llm = LLM('acme/tiny', dtype='float32', kv_cache_memory_bytes=4 << 20)\n"
            "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)\n"
            "print(list(out[0].outputs[0].token_ids))\n"
        )
        done = _run(code, [], env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert any("/resolve/" in r and r.endswith("model.safetensors") for r in hub.requests)
    (snapshot,) = Path(hub_env["HF_HOME"]).rglob("snapshots/*")
    downloaded = sorted(p.name for p in snapshot.rglob("*") if p.is_file())
    assert "config.json" in downloaded and "model.safetensors" in downloaded
    assert "pytorch_model.bin" not in downloaded and "logo.png" not in downloaded
    assert json.loads(done.stdout.strip().splitlines()[-1]) == hf_greedy(tiny_llama, [5, 6, 7], 8)
    # Later starts work offline from the cache.
    again = _run(RESOLVE, ["acme/tiny"], {**hub_env, "HF_HUB_OFFLINE": "1"})
    assert again.returncode == 0 and again.stdout.strip() == str(snapshot)


def test_revision_and_download_dir(repo_dir, tiny_qwen2, hub_env, tmp_path):
    with StandInHub({"acme/tiny": {"main": repo_dir, "v2": tiny_qwen2}}) as hub:
        env = {**hub_env, "HF_ENDPOINT": hub.endpoint}
        done = _run(RESOLVE, ["acme/tiny", "v2", str(tmp_path / "dl")], env)
        assert done.returncode == 0, done.stderr[-2000:]
        path = done.stdout.strip()
        assert path.startswith(str(tmp_path / "dl"))
        assert (tiny_qwen2 / "config.json").read_text() == open(os.path.join(path, "config.json")).read()
        missing = _run(RESOLVE, ["acme/tiny", "v9"], env)
        assert missing.returncode == 1 and "has no revision 'v9'" in missing.stderr


@pytest.mark.parametrize(
    "model, extra_env, message",
    [
        ("acme/nothing", {"HF_TOKEN": "secret"}, "has no such model"),
        ("acme/tiny", {"HF_TOKEN": "wrong"}, "could not be downloaded from .*401 Unauthorized"),
        ("acme/tiny", {"HF_HUB_OFFLINE": "1"}, "not in the Hugging Face cache .*, and HF_HUB_OFFLINE is set"),
        ("./no/such/dir", {}, "is not a local directory with config.json"),
    ],
)
def test_missing_model_is_a_clear_error_in_under_2_s(repo_dir, hub_env, model, extra_env, message):
    with StandInHub({"acme/tiny": {"main": repo_dir}}, token="secret") as hub:
        env = {**hub_env, "HF_ENDPOINT": hub.endpoint, **extra_env}
        started = time.perf_counter()
        done = _run(RESOLVE, [model], env)
        elapsed = time.perf_counter() - started
    assert done.returncode == 1
    assert re.search(message, done.stderr.strip().splitlines()[-1]), done.stderr[-1500:]
    assert elapsed < 2.0


def test_serve_downloads_by_hub_id(repo_dir, hub_env):
    """``pagedllm serve ORG/NAME --revision R`` downloads before the engine starts and serves it."""
    from tests.server_utils import RemoteServer

    with StandInHub({"acme/tiny": {"v1": repo_dir}}) as hub:
        env = {**hub_env, "HF_ENDPOINT": hub.endpoint}
        server = RemoteServer("acme/tiny", "--revision", "v1", env=env)
        try:
            models = server.get("/v1/models").json()
        finally:
            server.close()
    assert [m["id"] for m in models["data"]] == ["acme/tiny"]
