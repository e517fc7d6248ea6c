"""Issue 12 part 2: the model's own defaults apply (vLLM's ``--generation-config auto``).

A checkpoint's generation_config.json (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``max_new_tokens`` -> ``max_tokens``) sets the sampling defaults of
requests that do not give them, offline (``LLM.get_default_sampling_params``, ``generate``
without params) and online (absent or null fields); they are logged at start-up;
``generation_config="vllm"`` / ``--generation-config vllm`` ignores them and a folder
replaces them. The checkpoints are copies of ``tiny_llama`` with their own
generation_config.json.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.processor import Processor
from pagedllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser
from pagedllm.tokenizer import get_tokenizer
from tests.helpers import hf_greedy
from tests.server_utils import RemoteServer

KV_BYTES = 8 << 20
MAX_MODEL_LEN = 256
GREEDY_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 7, "do_sample": False}
ALL_FIELDS = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
    "max_new_tokens": 9, "do_sample": True,
}  # fmt: skip


def _with_generation_config(tiny_llama: Path, folder: Path, fields: dict) -> Path:
    """A copy of ``tiny_llama`` whose generation_config.json also holds ``fields``."""
    shutil.copytree(tiny_llama, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def greedy_model(tiny_llama, tmp_path_factory) -> Path:
    return _with_generation_config(tiny_llama, tmp_path_factory.mktemp("gen") / "greedy", GREEDY_DEFAULTS)


def _model_config(path: Path, generation_config: str = "auto"):
    args = EngineArgs(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, generation_config=generation_config)
    return args.create_engine_config().model_config


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN, **kwargs)


def test_every_field_is_read_and_max_new_tokens_becomes_max_tokens(tiny_llama, tmp_path, caplog):
    model = _with_generation_config(tiny_llama, tmp_path / "all", ALL_FIELDS)
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        defaults = _model_config(model).get_diff_sampling_param()
    assert defaults == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 9,
    }  # fmt: skip
    [record] = [r for r in caplog.records if "Default sampling parameters have been overridden" in r.message]
    assert "'temperature': 0.7" in record.message and "--generation-config vllm" in record.message
    assert _model_config(model, "vllm").get_diff_sampling_param() == {}
    assert _model_config(tiny_llama).get_diff_sampling_param() == {}  # eos ids and do_sample only


def test_do_sample_false_is_not_read_as_vllm(tiny_llama, tmp_path):
    """vLLM reads only the sampling fields: ``do_sample: false`` beside a temperature samples."""
    model = _with_generation_config(tiny_llama, tmp_path / "nosample", {"do_sample": False, "temperature": 0.6})
    assert _model_config(model).get_diff_sampling_param() == {"temperature": 0.6}


def test_a_folder_replaces_the_model_s_file_and_caps_max_tokens(tiny_llama, greedy_model, tmp_path):
    folder = tmp_path / "override"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 3, "max_new_tokens": 5}))
    config = _model_config(greedy_model, str(folder))
    processor = Processor(config, get_tokenizer(config.tokenizer_path))
    assert processor.default_sampling_params == {"top_k": 3, "max_tokens": 5}
    assert processor.resolve_max_tokens(10, 100) == 5  # vLLM's override_max_tokens: a cap
    auto = _model_config(greedy_model)
    auto_processor = Processor(auto, get_tokenizer(auto.tokenizer_path))
    assert auto_processor.resolve_max_tokens(10, 100) == 100  # "auto": a default, not a cap
    assert auto_processor.resolve_max_tokens(10, None, default=None) == 7
    assert auto_processor.resolve_max_tokens(MAX_MODEL_LEN - 3, None, default=None) == 3  # cut to the room
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        _model_config(tiny_llama, str(tmp_path / "missing"))


def test_an_invalid_default_fails_at_start_naming_the_file(tiny_llama, tmp_path):
    model = _with_generation_config(tiny_llama, tmp_path / "bad", {"top_p": 0.0})
    config = _model_config(model)
    with pytest.raises(ValueError, match=r"generation_config.json sets an invalid default sampling parameter: top_p"):
        Processor(config, get_tokenizer(config.tokenizer_path))


def test_offline_defaults_give_greedy_output_equal_to_hf(greedy_model):
    llm = _llm(greedy_model)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_p, defaults.top_k) == (0.0, 7, 1.0, -1)
    prompt = llm.get_tokenizer().encode("The quick brown fox")
    [output] = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == hf_greedy(greedy_model, prompt, 7)
    explicit = SamplingParams(max_tokens=3)  # given params are the caller's: no model defaults
    assert explicit.temperature == 1.0
    vllm_defaults = _llm(greedy_model, generation_config="vllm").get_default_sampling_params()
    assert (vllm_defaults.temperature, vllm_defaults.max_tokens) == (1.0, 16)


def test_serve_flag_reaches_the_engine_args():
    import argparse

    parser = make_arg_parser(argparse.ArgumentParser(prog="pagedllm serve"))
    assert engine_args_from(parser.parse_args([])).generation_config == "auto"
    assert engine_args_from(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"


def _server(model: Path, *flags: str) -> RemoteServer:
    return RemoteServer(model, "--served-model-name", "m", "--max-model-len", str(MAX_MODEL_LEN), *flags)


def test_server_uses_the_model_defaults_and_logs_them(greedy_model):
    prompt = "The quick brown fox"
    server = _server(greedy_model)
    try:
        assert "Default sampling parameters have been overridden" in server.log_text()
        assert "'temperature': 0.0, 'max_tokens': 7" in server.log_text()
        chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "ignore_eos": True}
        first, second = (server.post("/v1/chat/completions", json=chat).json() for _ in range(2))
        assert first["usage"]["completion_tokens"] == 7  # max_new_tokens
        assert first["choices"][0]["message"] == second["choices"][0]["message"]  # temperature 0: greedy
        nulls = {**chat, "temperature": None, "max_tokens": None}
        assert server.post("/v1/chat/completions", json=nulls).json()["choices"] == first["choices"]
        body = {"model": "m", "prompt": prompt, "ignore_eos": True}
        absent = server.post("/v1/completions", json=body).json()
        assert absent["usage"]["completion_tokens"] == 16  # OpenAI's default wins over the model's (as vLLM)
        null = server.post("/v1/completions", json={**body, "max_tokens": None}).json()
        assert null["usage"]["completion_tokens"] == 7
        assert absent["choices"][0]["text"].startswith(null["choices"][0]["text"])
        hot = server.post("/v1/completions", json={**body, "max_tokens": 7, "temperature": 5.0, "seed": 1}).json()
        assert hot["choices"][0]["text"] != null["choices"][0]["text"]  # a given field wins
    finally:
        server.close()


def test_server_with_generation_config_vllm_ignores_them(greedy_model):
    server = _server(greedy_model, "--generation-config", "vllm")
    try:
        assert "Default sampling parameters have been overridden" not in server.log_text()
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "seed": 3}
        response = server.post("/v1/chat/completions", json=chat).json()
        assert response["usage"]["completion_tokens"] == MAX_MODEL_LEN - response["usage"]["prompt_tokens"]
    finally:
        server.close()


def test_override_generation_config(tiny_llama):
    """vLLM's ``--override-generation-config``: its fields replace the generation config's,
    also with ``generation_config="vllm"``; the command line takes a JSON object."""
    import argparse

    from pagedllm.entrypoints.openai.cli_args import json_object

    llm = LLM(str(tiny_llama), generation_config="vllm", kv_cache_memory_bytes=4 << 20,
              override_generation_config={"temperature": 0.25, "max_new_tokens": 3})
    params = llm.get_default_sampling_params()
    assert params.temperature == 0.25 and params.max_tokens == 3
    assert json_object('{"top_p": 0.5}') == {"top_p": 0.5}
    with pytest.raises(argparse.ArgumentTypeError, match="expected a JSON object"):
        json_object("[1]")
    with pytest.raises(argparse.ArgumentTypeError, match="invalid JSON"):
        json_object("{temperature: 1}")
