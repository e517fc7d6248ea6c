"""Engine and server options are declared once, on ``EngineArgs`` / ``FrontendConfig`` fields:
``pagedllm serve`` and every engine-building ``pagedllm bench`` subcommand take the same
engine flags (names, types, choices), and each flag reaches its field."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.config import EngineArgs
from pagedllm.config.flags import FLAG, NOT_A_FLAG, flag_fields, option_string
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import FrontendConfig, engine_args_from

#: The bench subcommands that build an engine (or its configuration), with the flags each needs.
ENGINE_BENCHES = {
    "throughput": [], "latency": [], "prefix-caching": [], "perplexity": ["--dataset-path", "x.txt"],
    "startup": [], "grammar-compile": [],
}  # fmt: skip

#: One flag value per non-switch engine flag, and the field value it must give.
SAMPLES = {
    "model": ("m", "m"), "tokenizer": ("t", "t"), "revision": ("v1", "v1"), "tokenizer_revision": ("v2", "v2"),
    "download_dir": ("/d", "/d"), "dtype": ("half", "half"), "max_model_len": ("4k", 4000),
    "otlp_traces_endpoint": ("http://c:4317", "http://c:4317"), "collect_detailed_traces": ("model", ["model"]),
    "block_size": ("32", 32), "max_num_seqs": ("3", 3), "max_num_batched_tokens": ("1K", 1024),
    "max_num_active_seqs": ("2", 2), "scheduling_policy": ("priority", "priority"),
    "kv_cache_memory_bytes": ("4G", 4 * 2**30), "gpu_memory_utilization": ("0.5", 0.5), "seed": ("7", 7),
    "prefix_caching_hash_algo": ("xxhash", "xxhash"), "attention_backend": ("TORCH_SDPA", "TORCH_SDPA"),
    "generation_config": ("vllm", "vllm"), "override_generation_config": ('{"top_k": 2}', {"top_k": 2}),
    "quantization": ("int8", "int8"), "quantization_config": ('{"group_size": 128}', {"group_size": 128}),
    "distributed_executor_backend": ("mp", "mp"), "tensor_parallel_size": ("2", 2),
    "pipeline_parallel_size": ("2", 2), "data_parallel_size": ("2", 2), "load_format": ("gguf", "gguf"),
    "kv_cache_dtype": ("fp8", "fp8"), "tokenizer_mode": ("hf", "hf"), "cpu_offload_gb": ("0", 0.0), "kv_offloading_size": ("0.5", 0.5),
    "kv_offloading_path": ("/kv", "/kv"),
    "structured_outputs_config": ('{"backend": "guidance"}', {"backend": "guidance"}),
    "compilation_config": ("3", {"level": 3}),
    "task": ("embed", "embed"),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}', {"method": "ngram", "num_speculative_tokens": 2}),
    "max_loras": ("2", 2), "max_lora_rank": ("8", 8), "max_cpu_loras": ("4", 4), "max_logprobs": ("5", 5),
    "num_gpu_blocks_override": ("64", 64), "max_seq_len_to_capture": ("1024", 1024), "swap_space": ("2", 2.0),
    "hf_overrides": ('{"rope_theta": 5.0}', {"rope_theta": 5.0}),
    "kv_transfer_config": ('{"kv_role": "kv_producer"}', {"kv_role": "kv_producer"}), "role": ("decode", "decode"),
    "runner": ("pooling", "pooling"), "convert": ("embed", "embed"),
    "pooler_config": ('{"pooling_type": "MEAN"}', {"pooling_type": "MEAN"}),
    "limit_mm_per_prompt": ('{"image": 2}', {"image": 2}), "mm_processor_kwargs": ('{"do_resize": false}', {"do_resize": False}),
    "allowed_local_media_path": ("/media", "/media"), "allowed_media_domains": ("a.example", ["a.example"]),
    "media_io_kwargs": ('{"video": {"num_frames": 8}}', {"video": {"num_frames": 8}}),
}  # fmt: skip


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    bench = _subparser(root, "bench")
    return {"serve": _subparser(root, "serve"), **{f"bench {name}": _subparser(bench, name) for name in ENGINE_BENCHES}}


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    names = {f.name for f in flag_fields(EngineArgs)}
    return {a.dest: a for a in parser._actions if a.dest in names}


def _signature(action: argparse.Action) -> tuple:
    return (tuple(action.option_strings), action.type, tuple(action.choices or ()), action.nargs, type(action))


def test_every_engine_args_field_is_one_flag_or_marked(parsers):
    for f in dataclasses.fields(EngineArgs):
        assert (FLAG in f.metadata) != (NOT_A_FLAG in f.metadata), f.name
    assert [f.name for f in dataclasses.fields(EngineArgs) if NOT_A_FLAG in f.metadata] == ["usage_context"]
    serve = parsers["serve"]
    for f in flag_fields(EngineArgs):
        owners = [a for a in serve._actions if a.dest == f.name]
        assert len(owners) == 1 and owners[0].option_strings[0] == option_string(f.name), f.name
    assert not [a for a in serve._actions if a.dest == "usage_context"]


def test_serve_help_groups():
    groups = {g.title: {a.dest for a in g._group_actions} for g in _subparser(build_parser(), "serve")._action_groups}
    model_flags = {"model", "tokenizer", "revision", "tokenizer_revision", "download_dir"}
    engine_flags = {f.name for f in flag_fields(EngineArgs)}
    assert model_flags <= groups["options"]
    assert groups["engine"] == engine_flags - model_flags - {"disable_log_stats"}
    assert groups["server"] == {f.name for f in flag_fields(FrontendConfig)} | {"disable_log_stats"}


@pytest.mark.parametrize("bench", ENGINE_BENCHES)
def test_bench_takes_serves_engine_flags(parsers, bench):
    serve, sub = _engine_actions(parsers["serve"]), _engine_actions(parsers[f"bench {bench}"])
    assert {name: _signature(a) for name, a in sub.items()} == {name: _signature(a) for name, a in serve.items()}
    args = parsers[f"bench {bench}"].parse_args(["--kv-cache-memory-bytes", "4G", "--dtype", "half", *ENGINE_BENCHES[bench]])
    assert (args.kv_cache_memory_bytes, args.dtype) == (4 * 2**30, "half")


def test_serve_parses_human_sizes_and_dtype_aliases(parsers):
    args = parsers["serve"].parse_args(["--kv-cache-memory-bytes", "4G", "--dtype", "half"])
    assert (args.kv_cache_memory_bytes, args.dtype) == (4 * 2**30, "half")


def test_bench_passes_only_the_given_flags(parsers):
    from pagedllm.benchmarks.throughput import engine_kwargs

    args = parsers["bench throughput"].parse_args(["--max-num-seqs", "3", "--no-enable-prefix-caching"])
    assert engine_kwargs(args) == {"dtype": "auto", "seed": 0, "max_num_seqs": 3, "enable_prefix_caching": False}


def test_startup_gives_serve_the_same_flags(parsers):
    from pagedllm.benchmarks.startup import engine_flags

    args = parsers["bench startup"].parse_args(["--kv-cache-memory-bytes", "4G", "--no-enable-prefix-caching", "-tp", "2"])
    assert engine_flags(args) == [
        "--dtype", "auto", "--kv-cache-memory-bytes", str(4 * 2**30), "--no-enable-prefix-caching",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip


def test_engine_args_from_round_trips_every_flag(parsers):
    serve = parsers["serve"]
    switches = {}
    for f in flag_fields(EngineArgs):
        action = next(a for a in serve._actions if a.dest == f.name)
        if action.nargs == 0:  # a switch: give the side that is not the default
            on = f.default is not True
            switches[f.name] = ([option_string(f.name) if on else "--no-" + option_string(f.name)[2:]], on)
    # A prefill / decode role is refused with prefix caching on (the default).
    companions = {"kv_transfer_config": ["--no-enable-prefix-caching"], "role": ["--no-enable-prefix-caching"]}
    samples = {name: ([option_string(name), text, *companions.get(name, [])], value)
               for name, (text, value) in SAMPLES.items()}
    assert set(samples) | set(switches) == {f.name for f in flag_fields(EngineArgs)}
    for name, (argv, value) in {**samples, **switches}.items():
        engine_args = engine_args_from(serve.parse_args(argv))
        assert getattr(engine_args, name) == value, name
        assert engine_args.usage_context == "api_server"


def test_engine_args_from_refuses_missing_flags():
    with pytest.raises(ValueError, match="lack flags of EngineArgs: --tokenizer, .*--max-num-seqs"):
        EngineArgs.from_cli_args(argparse.Namespace(model=None))


def test_frontend_config_has_exactly_the_server_flags(parsers):
    serve = parsers["serve"]
    server = next(g for g in serve._action_groups if g.title == "server")
    flags = {f.name for f in flag_fields(FrontendConfig)}
    assert flags == {a.dest for a in server._group_actions} - {"disable_log_stats"}
    args = serve.parse_args(["--port", "9000", "--api-key", "k1", "k2", "--allowed-origins", '["https://a"]',
                             "--disable-log-stats", "--lora-modules", "a=/p"])  # fmt: skip
    frontend = FrontendConfig.from_cli_args(args)
    assert (frontend.port, frontend.api_key, frontend.allowed_origins) == (9000, ["k1", "k2"], ["https://a"])
    assert frontend.disable_log_stats is True and frontend.host == "127.0.0.1"
    assert frontend.lora_modules == [{"name": "a", "path": "/p", "base_model_name": None}]
    with pytest.raises(dataclasses.FrozenInstanceError):
        frontend.port = 1  # type: ignore[misc]
    assert FrontendConfig().allowed_methods == ["*"] and FrontendConfig().shutdown_timeout == 5.0
