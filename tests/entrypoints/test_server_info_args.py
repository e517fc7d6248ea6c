"""The flags ``GET /server_info`` reports (``pagedllm.entrypoints.openai.server_info``): every
spelling of ``--api-key`` and its values left out (``arg_parsing.drop_flag``), ``--config FILE``
replaced by its flags with the command line still winning (``arg_parsing.inline_config_file``),
and what is left parses to the same server configuration."""

from __future__ import annotations

from pagedllm.entrypoints.arg_parsing import drop_flag
from pagedllm.entrypoints.openai.cli_args import serve_parser
from pagedllm.entrypoints.openai.server_info import reported_serve_args


def _parse(args):
    return serve_parser().parse_args(args)


def test_every_spelling_of_the_key_is_left_out():
    parser = serve_parser()
    cases = [
        ["m", "--api-key", "k1", "k2", "--port", "8001"],
        ["m", "--api-key=k1", "--port", "8001"],
        ["m", "--api_key", "k1", "--port", "8001"],
        ["m", "--api-k", "k1", "k2", "--port", "8001"],
        ["--api-key", "k1", "--port", "8001", "m"],
    ]
    for args in cases:
        kept = drop_flag(parser, args, "--api-key")
        assert not any("k1" in arg or "k2" in arg for arg in kept), args
        parsed = _parse(kept)
        assert parsed.api_key is None and parsed.port == 8001 and parsed.model_tag == "m"
    assert drop_flag(parser, ["m", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--enable-lora"],
                     "--lora-modules") == ["m", "--enable-lora"]


def test_the_config_file_is_inlined_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 128\nport: 9000\nenable-lora: true\napi-key: [k1]\n")
    args = ["m", "--config", str(config), "--port", "8001", "--api-key", "k2"]
    reported = reported_serve_args(serve_parser(), args)
    assert "--config" not in reported and not any(key in reported for key in ("k1", "k2"))
    parsed, original = _parse(reported), _parse(args)
    assert (parsed.max_model_len, parsed.port, parsed.enable_lora) == (original.max_model_len, 8001, True)
    assert parsed.api_key is None


def test_a_config_files_dotted_keys_are_reported_as_dotted_flags(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("structured-outputs-config.backend: guidance\nstructured-outputs-config: {max_string_length: 64}\n")
    args = ["m", "--config", str(config), "--structured-outputs-config.disable_fallback", "true"]
    reported = reported_serve_args(serve_parser(), args)
    assert "--structured-outputs-config.backend" in reported and "--config" not in reported
    expected = {"backend": "guidance", "max_string_length": 64, "disable_fallback": True}
    assert _parse(reported).structured_outputs_config == _parse(args).structured_outputs_config == expected
