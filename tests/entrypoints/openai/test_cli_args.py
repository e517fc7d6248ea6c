"""``pagedllm serve`` flags: vLLM's names, human-readable sizes, API key from the
environment, chat template file or literal, and one-line errors (exit code 2)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pagedllm.distributed import get_open_port
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import engine_args_from, human_readable_int, resolve_api_key
from pagedllm.entrypoints.chat_utils import load_chat_template
from tests.helpers import cpu_only

FLAGS = [
    "--host", "--port", "--served-model-name", "--dtype", "--max-model-len", "--block-size",
    "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--prefix-caching-hash-algo", "--seed",
    "--chat-template", "--api-key", "--disable-log-requests", "--uvicorn-log-level", "--attention-backend",
]  # fmt: skip


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "text, value",
    [("8192", 8192), ("32k", 32000), ("32K", 32768), ("1M", 1048576), ("1m", 1000000), ("25.6k", 25600), ("2K", 2048)],
)
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


def test_defaults_and_flags():
    args = _parse()
    assert args.model_tag is None and args.host == "127.0.0.1" and args.port == 8000
    engine_args = engine_args_from(_parse())
    assert engine_args.model is None  # the shipped default model (resolve_model_path(None))
    args = _parse(
        "some/model", "--max-model-len", "32k", "--served-model-name", "a", "b", "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes", "512M", "--block-size", "32", "--prefix-caching-hash-algo", "xxhash",
        "--attention-backend", "TORCH_SDPA",
    )  # fmt: skip
    args.model = args.model_tag
    engine_args = engine_args_from(args)
    assert engine_args.model == "some/model"
    assert engine_args.max_model_len == 32000
    assert engine_args.kv_cache_memory_bytes == 512 * 1024**2
    assert engine_args.block_size == 32 and engine_args.enable_prefix_caching is False
    assert engine_args.prefix_caching_hash_algo == "xxhash"
    assert engine_args.attention_backend == "TORCH_SDPA"
    assert engine_args_from(_parse()).attention_backend is None
    assert args.served_model_name == ["a", "b"]
    assert _parse("--max-model-len", "auto").max_model_len is None


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse("--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-model-len", "lots"],
        ["--max-model-len", "0"],
        ["--port", "99999"],
        ["--block-size", "7"],
        ["--dtype", "float8"],
        ["--gpu-memory-utilization", "1.5"],
        ["--max-num-seqs", "-1"],
        ["--kv-cache-memory-bytes", "1.5x"],
    ],
)
def test_bad_flag_value_is_one_line_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedllm serve: error: argument " + argv[0]), err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["{model}", "--max-model-len", "1M"], "max_model_len"),
        (["/no/such/model/dir"], "/no/such/model/dir"),
        (["{model}", "--chat-template", "no_such_template_file.jinja"], "chat-template"),
    ],
)
def test_bad_value_found_at_start_is_one_line_exit_2(argv, fragment, tiny_llama, capsys):
    # a free port: the port check comes first, and another server may hold the default 8000
    args = _parse(*[a.format(model=tiny_llama) for a in argv], "--port", str(get_open_port()))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedllm serve: error:") and fragment in err, err


def test_bad_flag_in_a_real_process_has_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--max-model-len", "lots"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "--max-model-len" in result.stderr


def test_api_key_sources(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert resolve_api_key(_parse()) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_api_key(_parse()) == ["from-vllm"]
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-pagedllm")
    assert resolve_api_key(_parse()) == ["from-pagedllm"]
    assert resolve_api_key(_parse("--api-key", "from-flag")) == ["from-flag"]
    assert resolve_api_key(_parse("--api-key", "k1", "k2")) == ["k1", "k2"]  # vLLM: any of them


def test_chat_template_file_or_literal(tmp_path):
    literal = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_chat_template(literal) == literal
    path = tmp_path / "template.jinja"
    path.write_text(literal)
    assert load_chat_template(str(path)) == literal
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither"):
        load_chat_template("missing.jinja")
    with pytest.raises(ValueError, match="syntax"):
        load_chat_template("{% for m in messages %}")


@cpu_only
def test_default_step_token_budget_follows_vllm_on_cpu(tiny_llama):
    """vLLM's CPU defaults: 2048 tokens a step for the server, 4096 for offline ``LLM``;
    never below max_num_seqs; an explicit flag wins."""
    from pagedllm.config import EngineArgs

    def budget(engine_args: EngineArgs) -> int:
        return engine_args.create_engine_config().scheduler_config.max_num_batched_tokens

    args = _parse(str(tiny_llama))
    args.model = args.model_tag
    served = engine_args_from(args)
    assert served.usage_context == "api_server" and budget(served) == 2048
    assert budget(EngineArgs(model=str(tiny_llama))) == 4096
    assert budget(EngineArgs(model=str(tiny_llama), max_num_seqs=5000)) == 5000
    args = _parse(str(tiny_llama), "--max-num-batched-tokens", "3k")
    args.model = args.model_tag
    assert budget(engine_args_from(args)) == 3000
    with pytest.raises(ValueError, match="usage_context"):
        EngineArgs(model=str(tiny_llama), usage_context="batch").create_engine_config()
