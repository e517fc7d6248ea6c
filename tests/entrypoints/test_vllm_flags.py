"""Issue 12 part 1: vLLM's ``serve`` flags are accepted, with vLLM's names and defaults.

Each flag acts as in vLLM (``--max-logprobs``, ``--num-gpu-blocks-override``, CORS,
``--root-path``, TLS, ``--uds``, ``--config``, ``--response-role``), is a documented no-op,
or, for a value asking for something not built, fails at once with "... is not supported
yet" (one line, exit code 2). A misspelled flag gets a "did you mean" and the usage line.
"""

from __future__ import annotations

import argparse
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import engine_args_from, uvicorn_tls_kwargs
from tests.server_utils import RemoteServer

#: Flags copied from vLLM launch lines, with the values pagedllm runs (no-ops included).
ACCEPTED = [
    "-tp", "1", "--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--distributed-executor-backend", "uni",
    "--trust-remote-code", "--enforce-eager", "--max-logprobs", "50", "--enable-chunked-prefill", "--swap-space", "8",
    "--tokenizer-mode", "auto", "--load-format", "safetensors", "--num-gpu-blocks-override", "100",
    "--kv-cache-dtype", "auto", "--max-seq-len-to-capture", "4096", "--disable-custom-all-reduce",
    "--disable-sliding-window", "--cpu-offload-gb", "0", "--enable-log-requests", "--response-role", "bot",
    "--return-tokens-as-token-ids",
    "--allowed-origins", '["http://a.example"]', "--allowed-methods", '["GET", "POST"]', "--allowed-headers", "X-A",
    "--allow-credentials", "--root-path", "/api", "--uds", "/tmp/x.sock", "--ssl-keyfile", "k.pem",
    "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2",
]  # fmt: skip


def _parse(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    args.model = args.model_tag or args.model
    return args


def test_vllm_defaults():
    args = _parse()
    engine_args = engine_args_from(args)
    assert (engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size, engine_args.data_parallel_size) == (1, 1, 1)
    assert engine_args.max_logprobs == 20 and engine_args.swap_space == 4 and engine_args.max_seq_len_to_capture == 8192
    assert engine_args.num_gpu_blocks_override is None and engine_args.enable_chunked_prefill is None
    assert (engine_args.load_format, engine_args.kv_cache_dtype, engine_args.tokenizer_mode) == ("auto", "auto", "auto")
    assert engine_args.quantization is None and engine_args.trust_remote_code is False
    assert engine_args.enforce_eager is False and engine_args.distributed_executor_backend is None
    assert args.allowed_origins == args.allowed_methods == args.allowed_headers == ["*"]
    assert args.allow_credentials is False and args.root_path is None and args.uds is None
    assert args.response_role == "assistant" and args.ssl_cert_reqs == 0
    assert uvicorn_tls_kwargs(args) == {"ssl_keyfile": None, "ssl_certfile": None, "ssl_ca_certs": None, "ssl_cert_reqs": 0}


def test_vllm_flags_are_accepted_and_reach_the_engine_and_server():
    args = _parse(*ACCEPTED)
    engine_args = engine_args_from(args)
    assert engine_args.max_logprobs == 50 and engine_args.num_gpu_blocks_override == 100
    assert engine_args.trust_remote_code and engine_args.enforce_eager and engine_args.swap_space == 8
    assert engine_args.distributed_executor_backend == "uni" and engine_args.enable_chunked_prefill is True
    assert args.allowed_origins == ["http://a.example"] and args.allowed_methods == ["GET", "POST"]
    assert args.allowed_headers == ["X-A"] and args.allow_credentials and args.root_path == "/api"
    assert args.uds == "/tmp/x.sock"
    assert uvicorn_tls_kwargs(args) == {
        "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem", "ssl_ca_certs": "ca.pem", "ssl_cert_reqs": 2
    }  # fmt: skip
    structured = engine_args_from(_parse("--structured-outputs-config", '{"backend": "guidance", "disable_fallback": true}'))
    assert structured.structured_outputs_config == {"backend": "guidance", "disable_fallback": True}
    int4 = engine_args_from(_parse("--quantization", "int4", "--quantization-config", '{"group_size": 128}'))
    assert int4.quantization == "int4" and int4.quantization_config == {"group_size": 128}
    long_forms = _parse("--tensor-parallel-size", "1", "--max_model_len=8k")
    assert long_forms.tensor_parallel_size == 1 and long_forms.max_model_len == 8000


def test_dotted_config_keys_and_guided_decoding_flags():
    """vLLM's ``--structured-outputs-config.backend guidance`` (one key of a JSON flag; the value
    read as JSON when it is JSON) and its earlier ``--guided-decoding-backend`` / ``--guided-decoding-disable-*``
    flags set the same keys as the JSON object would; a key given both ways takes the later one."""
    dotted = engine_args_from(_parse("--structured-outputs-config.backend", "guidance",
                                     "--structured-outputs-config.disable_fallback=true"))
    assert dotted.structured_outputs_config == {"backend": "guidance", "disable_fallback": True}
    legacy = engine_args_from(_parse("--guided-decoding-backend", "xgrammar", "--guided-decoding-disable-any-whitespace"))
    assert legacy.structured_outputs_config == {"backend": "xgrammar", "disable_any_whitespace": True}
    merged = engine_args_from(_parse("--structured-outputs-config", '{"backend": "guidance", "max_string_length": 64}',
                                     "--guided_decoding_backend=xgrammar"))
    assert merged.structured_outputs_config == {"backend": "xgrammar", "max_string_length": 64}
    quant = engine_args_from(_parse("--quantization", "int4", "--quantization-config.group_size", "128"))
    assert quant.quantization_config == {"group_size": 128}


def test_dotted_key_of_a_flag_that_is_no_json_object_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--max-model-len.x", "1")
    assert exc.value.code == 2
    assert "unrecognized arguments: --max-model-len.x" in capsys.readouterr().err


def test_compilation_config_and_optimization_level_are_no_ops(capsys):
    """vLLM's ``-O3`` / ``-O 0`` (an optimization level) and ``--compilation-config JSON`` are
    taken as no-ops (nothing is compiled, no CUDA graphs); a level that is neither is refused."""
    assert engine_args_from(_parse("-O3")).compilation_config == {"level": 3}
    assert engine_args_from(_parse("-O", "0")).compilation_config == {"level": 0}
    given = engine_args_from(_parse("--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}'))
    assert given.compilation_config == {"cudagraph_capture_sizes": [1, 2]}
    assert engine_args_from(_parse("--compilation-config.level", "3")).compilation_config == {"level": 3}
    with pytest.raises(SystemExit) as exc:
        _parse("-Ofast")
    assert exc.value.code == 2
    assert "invalid value 'fast': expected an optimization level (0-3) or a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--help")
    assert "No-op: pagedllm compiles nothing and captures no CUDA graphs" in " ".join(capsys.readouterr().out.split())


def test_help_documents_the_vllm_flags_and_the_no_ops(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse("--help")
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: pagedllm serve [MODEL] [options]")
    for flag in [a for a in ACCEPTED if a.startswith("-")] + ["--config", "--quantization", "--tool-call-parser"]:
        assert flag in text, flag
    assert "--enforce-eager No-op: pagedllm captures no CUDA graphs." in text
    assert "No-op: preempted requests are recomputed, never swapped." in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--distributed-executor-backend", "external_launcher"], "distributed_executor_backend='external_launcher' is not supported yet"),
        (["--load-format", "pt"], "load_format='pt' is not supported yet"),
        (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype='bfloat16' is not supported yet"),
        (["--tokenizer-mode", "slow"], "tokenizer_mode='slow' is not supported yet"),
        (["--no-enable-chunked-prefill"], "enable_chunked_prefill=False is not supported yet"),
        (["--cpu-offload-gb", "2"], "cpu_offload_gb=2.0 is not supported yet"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be >= max_loras (4)."),
        (["--speculative-config", '{"method": "ngram"}'],
         "speculative_config['num_speculative_tokens'] must be an integer >= 1, got None."),
        (["--max-logprobs", "-2"], "max_logprobs must be -1 (the vocabulary size) or more, got -2."),
        (["--lora-modules", "sql=/x"], "--lora-modules needs --enable-lora."),
        (["--structured-outputs-config", '{"backend": "outlines"}'],
         "structured outputs backend must be one of auto, xgrammar, guidance, got 'outlines'."),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (
            ["--enable-auto-tool-choice", "--tool-call-parser", "hermez"],
            "invalid tool call parser: hermez (chose from { hermes,llama3_json,mistral,pythonic })",
        ),
        (["--reasoning-parser", "r2"], "invalid reasoning parser: r2 (chose from { deepseek_r1,gpt_oss,qwen3 })"),
    ],
)
def test_values_not_built_fail_at_once_in_one_line(argv, message, capsys):
    args = _parse(*argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedllm serve: error: ") and message in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-dp", "0"], "argument --data-parallel-size/-dp: invalid value '0': expected a positive integer"),
    ],
)
def test_server_features_not_built_fail_while_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"pagedllm serve: error: {message}\n" or (err.count("\n") == 1 and message in err), err


def test_lora_flags_take_vllm_forms():
    args = _parse("--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8",
                  "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}')
    assert args.lora_modules == [{"name": "sql", "path": "/a/sql", "base_model_name": None},
                                 {"name": "chat", "path": "/a/chat", "base_model_name": "base"}]
    engine_args = engine_args_from(args)
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank, engine_args.max_cpu_loras) == (
        True, 4, 32, 8)
    defaults = engine_args_from(_parse())
    assert (defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank, defaults.max_cpu_loras) == (
        False, 1, 16, None)
    for bad in ("sql", "=/x", '{"name": "x"}'):
        with pytest.raises(SystemExit):
            _parse("--lora-modules", bad)


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["--tensor-paralel-size", "1"], "--tensor-paralel-size (did you mean --tensor-parallel-size?)"),
        (["--max-logprbs=5"], "--max-logprbs=5 (did you mean --max-logprobs?)"),
        (["--enforce_eagre"], "--enforce-eagre (did you mean --enforce-eager?)"),
    ],
)
def test_misspelled_flag_gets_a_suggestion_and_the_serve_usage(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*argv)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage == "usage: pagedllm serve [MODEL] [options]"
    assert error.startswith("pagedllm serve: error: unrecognized arguments: ") and suggestion in error, error


def test_misspelled_flag_in_a_real_process():
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--trust-remote-cdoe"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "usage: pagedllm serve [MODEL] [options]",
        "pagedllm serve: error: unrecognized arguments: --trust-remote-cdoe (did you mean --trust-remote-code?)",
    ]


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: some/model\n"
        "max-num-seqs: 8\n"
        "max_logprobs: 7\n"
        "enable-prefix-caching: false\n"
        "trust-remote-code: true\n"
        "served-model-name: [a, b]\n"
        "allowed-origins: ['http://a.example']\n"
        "max-model-len: 4k\n"
    )
    args = _parse("--config", str(config), "--max-num-seqs", "4")
    engine_args = engine_args_from(args)
    assert engine_args.model == "some/model" and engine_args.max_num_seqs == 4
    assert engine_args.max_logprobs == 7 and engine_args.enable_prefix_caching is False
    assert engine_args.trust_remote_code and engine_args.max_model_len == 4000
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["http://a.example"]
    assert _parse("other/model", f"--config={config}").model == "other/model"  # MODEL wins, as vLLM


@pytest.mark.parametrize(
    "content, expected",
    [
        ("structured-outputs-config.backend: guidance\n", {"backend": "guidance"}),
        ("structured_outputs_config.disable_fallback: true\nstructured-outputs-config.backend: guidance\n",
         {"disable_fallback": True, "backend": "guidance"}),
        ("structured-outputs-config:\n  backend: guidance\n  disable_fallback: true\n",
         {"backend": "guidance", "disable_fallback": True}),
        # a dotted key merges over the file's own object, whichever comes first
        ("structured-outputs-config.backend: xgrammar\nstructured-outputs-config: {backend: guidance, max_string_length: 64}\n",
         {"backend": "xgrammar", "max_string_length": 64}),
    ],
)
def test_config_file_json_flag_as_mapping_or_dotted_keys(tmp_path, content, expected):
    """A JSON-object flag in ``--config``: a nested mapping or vLLM's dotted keys
    (``structured-outputs-config.backend: guidance``), as ``--structured-outputs-config.backend
    guidance`` on the command line; the command line's dotted keys merge over the file's."""
    config = tmp_path / "config.yaml"
    config.write_text(content)
    assert engine_args_from(_parse("--config", str(config))).structured_outputs_config == expected
    over = engine_args_from(_parse("--config", str(config), "--structured-outputs-config.backend", "xgrammar"))
    assert over.structured_outputs_config == {**expected, "backend": "xgrammar"}


def test_dotted_keys_nest():
    """``--x.a.b v`` sets ``{"a": {"b": v}}``, merged with the object's ``a`` (vLLM's nesting)."""
    args = _parse("--hf-overrides", '{"rope_scaling": {"type": "linear"}, "vocab_size": 10}',
                  "--hf-overrides.rope_scaling.factor", "2.0")
    assert args.hf_overrides == {"rope_scaling": {"type": "linear", "factor": 2.0}, "vocab_size": 10}


@pytest.mark.parametrize(
    "content, message",
    [
        ("tensor-paralel-size: 1\n", "unrecognized arguments in {path}: --tensor-paralel-size (did you mean --tensor-parallel-size?)"),
        ("max-model-len.x: 1\n", "unrecognized arguments in {path}: --max-model-len.x"),
        ("max-num-seqs: lots\n", "argument --max-num-seqs: invalid value 'lots'"),
        ("- a\n- b\n", "expected a mapping of flag names to values, got list"),
        ("a: [\n", "cannot read it"),
    ],
)
def test_bad_config_file_is_a_clear_error(tmp_path, content, message, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        _parse("--config", str(config))
    assert exit_info.value.code == 2
    assert message.format(path=config) in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--config", str(tmp_path / "missing.yaml"))
    assert "missing.yaml: cannot read it" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """One server for the flags that act: --config (with a flag the command line overrides),
    --max-logprobs, --num-gpu-blocks-override, CORS, --root-path, --response-role,
    --return-tokens-as-token-ids."""
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    config.write_text(
        "max-logprobs: 3\nnum-gpu-blocks-override: 999\nallowed-origins: ['http://ok.example']\n"
        "root-path: /api\nresponse-role: bot\nreturn-tokens-as-token-ids: true\n"
    )
    server = RemoteServer(
        tiny_llama, "--config", str(config), "--max-model-len", "512", "--num-gpu-blocks-override", "40",
        "--enforce-eager", "--swap-space", "1", "-tp", "1",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.close()


def test_max_logprobs_limits_requests(server):
    body = {"model": str(server.client().models.list().data[0].id), "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    ok = server.post("/v1/completions", json={**body, "logprobs": 3})
    assert ok.status_code == 200
    logprobs = ok.json()["choices"][0]["logprobs"]
    assert len(logprobs["top_logprobs"][0]) >= 3
    assert all(token.startswith("token_id:") for token in [*logprobs["tokens"], *logprobs["top_logprobs"][0]])
    token_id = int(logprobs["tokens"][0].removeprefix("token_id:"))
    assert 0 <= token_id < 32000 and len(logprobs["tokens"]) == 2
    texts = server.post("/v1/completions", json={**body, "logprobs": 1, "return_tokens_as_token_ids": False})
    assert not any(token.startswith("token_id:") for token in texts.json()["choices"][0]["logprobs"]["tokens"])
    for field, extra in (("logprobs", {"logprobs": 4}), ("prompt_logprobs", {"prompt_logprobs": 9})):
        too_many = server.post("/v1/completions", json={**body, **extra})
        assert too_many.status_code == 400, field
        error = too_many.json()["error"]
        assert error["type"] == "invalid_request_error" and "greater than max allowed: 3" in error["message"]
    chat = {"model": body["model"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = server.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 5})
    assert response.status_code == 400 and "Requested sample logprobs of 5" in response.json()["error"]["message"]


def test_num_gpu_blocks_override_sets_the_block_count(server):
    info = [key for key in server.metrics() if key.startswith("pagedllm:cache_config_info{")]
    assert len(info) == 1 and "num_gpu_blocks=40," in info[0], info


def test_cors(server):
    preflight = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"}
    allowed = httpx.options(server.url + "/v1/completions", headers=preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ok.example"
    refused = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    simple = server.get("/v1/models", headers={"Origin": "http://ok.example"})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "http://ok.example"


def test_root_path(server):
    assert server.get("/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert server.get("/api/v1/models").status_code == 200  # a proxy that keeps the prefix
    assert server.get("/v1/models").status_code == 200  # a proxy that strips it


def test_response_role(server):
    client = server.client()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].message.role == "bot"
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
    )
    assert next(iter(stream)).choices[0].delta.role == "bot"


class _UnixTLSServer(RemoteServer):
    """``pagedllm serve --uds PATH --ssl-keyfile ... --ssl-certfile ...``, reached over the socket."""

    def __init__(self, model: Path, socket_path: Path, key: Path, cert: Path) -> None:
        self.transport = httpx.HTTPTransport(uds=str(socket_path), verify=ssl.create_default_context(cafile=str(cert)))
        super().__init__(model, "--uds", str(socket_path), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))

    def health_ok(self) -> bool:
        with httpx.Client(transport=self.transport, timeout=1.0) as client:
            return client.get("https://localhost/health").status_code == 200


def test_unix_socket_with_tls(tiny_llama, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = _UnixTLSServer(tiny_llama, tmp_path / "pagedllm.sock", key, cert)
    try:
        with httpx.Client(transport=server.transport, timeout=60.0) as client:
            models = client.get("https://localhost/v1/models").json()
            completion = client.post(
                "https://localhost/v1/completions",
                json={"model": models["data"][0]["id"], "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
            )
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2.0)  # nothing listens on the TCP port
    finally:
        server.close()
