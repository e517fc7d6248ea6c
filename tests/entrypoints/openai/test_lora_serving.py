"""Serving LoRA adapters (vLLM's flags and routes) with the official ``openai`` client:
``--lora-modules`` in both forms, ``/v1/models``, each adapter's greedy output equal to
transformers' on the PEFT-merged model, runtime load / unload and their errors, the API
key, and ``pagedllm:lora_requests_info``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import openai
import pytest
import torch

from pagedllm.benchmarks.lora_adapters import make_random_adapter, write_adapter
from tests.helpers import hf_greedy, make_peft_adapter
from tests.server_utils import RemoteServer

API_KEY = "sk-lora-test"
PROMPT = [17, 305, 42, 99, 512, 7, 640, 33]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """sql, chat and late: PEFT adapters on tiny_llama (adapter folder, merged checkpoint)."""
    specs = {"sql": (8, ["q_proj", "v_proj", "down_proj"]), "chat": (4, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
             "late": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
    return {
        name: make_peft_adapter(tiny_llama, tmp_path_factory.mktemp(f"serve-{name}"), r=r, lora_alpha=2 * r,
                                target_modules=targets, seed=seed)
        for seed, (name, (r, targets)) in enumerate(specs.items())
    }


@pytest.fixture(scope="module")
def lora_server(tiny_llama, adapters) -> Iterator[RemoteServer]:
    chat_module = json.dumps({"name": "chat", "path": str(adapters["chat"][0]), "base_model_name": "tiny-llama"})
    env = dict(os.environ, PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    remote = RemoteServer(
        tiny_llama, "--served-model-name", "tiny-llama", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"sql={adapters['sql'][0]}", chat_module, api_key=API_KEY, env=env,
    )  # fmt: skip
    try:
        yield remote
    finally:
        remote.close()


def _greedy_text(client: openai.OpenAI, model: str) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert response.model == model
    return response.choices[0].text


def test_models_lists_the_adapters(lora_server, adapters):
    cards = {card.id: card for card in lora_server.client().models.list().data}
    assert list(cards) == ["tiny-llama", "sql", "chat"]
    assert cards["sql"].parent == "tiny-llama" and cards["sql"].root == str(adapters["sql"][0])
    assert cards["chat"].parent == "tiny-llama" and cards["chat"].root == str(adapters["chat"][0])
    assert cards["tiny-llama"].parent is None


def test_each_adapter_matches_its_merged_model(lora_server, adapters, tiny_llama, tokenizer):
    client = lora_server.client()
    texts = {model: _greedy_text(client, model) for model in ("tiny-llama", "sql", "chat")}
    assert texts["tiny-llama"] == tokenizer.decode(hf_greedy(tiny_llama, PROMPT, MAX_TOKENS))
    for name in ("sql", "chat"):
        assert texts[name] == tokenizer.decode(hf_greedy(adapters[name][1], PROMPT, MAX_TOKENS))
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "chat" and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert 'max_lora="2"' in lora_server.get("/metrics").text.replace("'", '"')


def test_runtime_load_and_unload(lora_server, adapters, tiny_llama, tmp_path, tokenizer):
    client = lora_server.client()
    body = {"lora_name": "late", "lora_path": str(adapters["late"][0])}
    assert lora_server.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    loaded = lora_server.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert [card.id for card in client.models.list().data] == ["tiny-llama", "sql", "chat", "late"]
    assert _greedy_text(client, "late") == tokenizer.decode(hf_greedy(adapters["late"][1], PROMPT, MAX_TOKENS))

    def error(path: str, payload: dict) -> tuple[int, str]:
        response = lora_server.post(path, json=payload)
        return response.status_code, response.json()["error"]["message"]

    assert error("/v1/load_lora_adapter", body) == (400, "The lora adapter 'late' has already been loaded.")
    status, message = error("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")})
    assert status == 404 and "adapter_config.json not found" in message
    big = make_random_adapter(str(tiny_llama), tmp_path / "big", rank=32)
    status, message = error("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert status == 400 and "rank 32 is greater than max_lora_rank 16" in message
    head = write_adapter(tmp_path / "head", {"r": 4, "target_modules": ["lm_head"]}, {})
    status, message = error("/v1/load_lora_adapter", {"lora_name": "head", "lora_path": str(head)})
    assert status == 400 and "['lm_head'] are not in this model" in message
    wide = write_adapter(tmp_path / "wide", {"r": 4, "target_modules": ["q_proj"]}, {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 80),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
    })  # fmt: skip
    status, message = error("/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(wide)})
    assert status == 400 and "shape [4, 80], but this base model needs [4, 64]" in message
    assert error("/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400

    # Unloaded while a request streams with it: that request finishes, new ones get a 404.
    stream = client.completions.create(model="late", prompt=PROMPT, max_tokens=48, temperature=0.0, stream=True)
    chunks = [next(iter(stream))]
    unloaded = lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="hi", max_tokens=2)
    assert error("/v1/unload_lora_adapter", {"lora_name": "late"}) == (404, "The lora adapter 'late' cannot be found.")
    # Re-loaded under the same name: served again, and the server still serves everyone.
    assert lora_server.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert _greedy_text(client, "late") == tokenizer.decode(hf_greedy(adapters["late"][1], PROMPT, MAX_TOKENS))
    assert lora_server.health_ok()


def test_runtime_routes_need_the_environment_variable(tiny_llama, adapters):
    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOW_RUNTIME_LORA_UPDATING")}
    remote = RemoteServer(tiny_llama, "--enable-lora", env=env)
    try:
        body = {"lora_name": "sql", "lora_path": str(adapters["sql"][0])}
        assert remote.post("/v1/load_lora_adapter", json=body).status_code == 404
    finally:
        remote.close()
