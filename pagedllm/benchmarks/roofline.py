"""``pagedllm bench roofline``: this machine's limits for a model, and how close a result is.

1. Matmul speed: every GEMM shape of the model (qkv, o, gate_up, down, lm_head) at several
   token counts (``--num-tokens``, the M of ``x[M, K] @ W[N, K]^T``), per dtype, timed with
   ``torch.nn.functional.linear`` (as the model runs them); GFLOP/s = 2·M·N·K / time (best
   of the repeats). The "model mix" row weights the shapes as one forward pass does (each
   layer shape x num_layers, plus lm_head); at the largest M it is the attainable peak
   used as the denominator of model-FLOPs utilisation (MFU). A square GEMM
   (``--square-size``, default 2048) is timed for reference.
2. Memory read bandwidth: ``torch.sum`` over a ``--bandwidth-mib`` float32 tensor (well
   beyond the caches), best of the repeats; also ``copy_`` into an existing tensor.
3. For each ``--result-json`` (from ``bench throughput``, ``bench latency`` or ``bench
   serve``): achieved FLOP/s and MFU; for latency results also prefill MFU, decode MFU and
   memory-bandwidth utilisation (MBU) of decode.

FLOPs (counted as vLLM / PaLM do): a token that goes through the model costs
2 x (matmul parameters of the layers) + attention 4 x num_layers x (heads x head_dim) x
context; each sampled token adds 2 x (lm_head parameters) for its logits (only sampled
positions get logits). Per request of P prompt and O output tokens: P + O - 1 tokens go
through the model at contexts 1 .. P + O - 1, and O logits rows are computed.
Bytes per decode step: all matmul weights (layers + lm_head + norms) once, plus the KV
cache read: 2 x num_layers x kv_heads x head_dim x dtype bytes per context token, for
every sequence in the batch.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pagedllm.benchmarks import machine_info, set_num_threads, write_json

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ModelSpec:
    """The sizes that FLOPs and bytes depend on (from config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelSpec":
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            hidden=hidden,
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            ffn=config["intermediate_size"],
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", False))
            or any(a.startswith("Qwen2") for a in config.get("architectures") or []),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def gemm_shapes(self) -> list[tuple[str, int, int, int]]:
        """(name, K in, N out, times per forward)."""
        h = self.hidden
        return [
            ("qkv_proj", h, self.q_dim + 2 * self.kv_dim, self.layers),
            ("o_proj", self.q_dim, h, self.layers),
            ("gate_up_proj", h, 2 * self.ffn, self.layers),
            ("down_proj", self.ffn, h, self.layers),
            ("lm_head", h, self.vocab, 1),
        ]

    @property
    def layer_matmul_params(self) -> int:
        """Matmul weights of all decoder layers."""
        return sum(k * n * times for name, k, n, times in self.gemm_shapes() if name != "lm_head")

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def small_params(self) -> int:
        """RMSNorm weights and q/k/v biases (read every step, negligible FLOPs)."""
        norms = self.layers * 2 * self.hidden + self.hidden
        bias = self.layers * (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return norms + bias

    @property
    def total_params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layer_matmul_params + self.small_params + embed + (0 if self.tied else self.lm_head_params)

    def weight_bytes_per_step(self, dtype_bytes: int) -> int:
        return (self.layer_matmul_params + self.lm_head_params + self.small_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def attention_flops(self, context: float) -> float:
        """Attention FLOPs of one token attending to ``context`` tokens (QK^T and AV)."""
        return 4.0 * self.layers * self.q_dim * context

    def token_flops(self, context: float, logits: bool) -> float:
        return 2.0 * self.layer_matmul_params + self.attention_flops(context) + (
            2.0 * self.lm_head_params if logits else 0.0)

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        """FLOPs of a whole request (prompt + output), as the module docstring says."""
        n = prompt_len + max(output_len, 1) - 1
        contexts = n * (n + 1) / 2.0  # sum of 1..n
        return (2.0 * self.layer_matmul_params * n + 4.0 * self.layers * self.q_dim * contexts
                + 2.0 * self.lm_head_params * output_len)

    def prefill_flops(self, prompt_len: int) -> float:
        contexts = prompt_len * (prompt_len + 1) / 2.0
        return 2.0 * self.layer_matmul_params * prompt_len + 4.0 * self.layers * self.q_dim * contexts \
            + 2.0 * self.lm_head_params


def load_spec(model: str) -> tuple[ModelSpec, dict[str, Any]]:
    from pagedllm.config import resolve_model_path

    config = json.loads((resolve_model_path(model) / "config.json").read_text())
    config = dict(config.get("text_config") or {}, **config) if "hidden_size" not in config else config
    return ModelSpec.from_config(config), config


def resolve_dtype_name(dtype: str, config: dict[str, Any]) -> str:
    """The compute dtype name pagedllm would use for ``dtype`` ("auto" follows the engine)."""
    if dtype != "auto":
        return dtype
    from pagedllm.config import resolve_dtype

    class _Config:  # resolve_dtype reads dtype (or torch_dtype)
        dtype = config.get("dtype") or config.get("torch_dtype")

    return str(resolve_dtype("auto", _Config())).replace("torch.", "")


def _time(fn: Callable[[], Any], min_time: float, min_reps: int = 3) -> float:
    """Best seconds per call of ``fn`` over at least ``min_reps`` calls and ``min_time`` seconds."""
    fn()
    fn()
    best = float("inf")
    reps = 0
    start = time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def measure_gemms(spec: ModelSpec, dtype_name: str, num_tokens: list[int], min_time: float,
                  square_size: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    mix: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for name, k, n, times in spec.gemm_shapes():
            weight = torch.randn(n, k, generator=gen).to(dtype)
            for m in num_tokens:
                x = torch.randn(m, k, generator=gen).to(dtype)
                seconds = _time(lambda: F.linear(x, weight), min_time)
                flops = 2.0 * m * n * k
                rows.append({"shape": name, "M": m, "K": k, "N": n, "seconds": seconds,
                             "gflops": flops / seconds / 1e9,
                             "weight_gbs": n * k * weight.element_size() / seconds / 1e9})
                agg = mix.setdefault(m, {"flops": 0.0, "seconds": 0.0})
                agg["flops"] += flops * times
                agg["seconds"] += seconds * times
            del weight
        square = None
        if square_size:
            a = torch.randn(square_size, square_size, generator=gen).to(dtype)
            b = torch.randn(square_size, square_size, generator=gen).to(dtype)
            seconds = _time(lambda: torch.mm(a, b), min_time)
            square = {"size": square_size, "seconds": seconds, "gflops": 2.0 * square_size ** 3 / seconds / 1e9}
    model_mix = {str(m): v["flops"] / v["seconds"] / 1e9 for m, v in sorted(mix.items())}
    peak = max(model_mix.values()) if model_mix else 0.0
    return {"dtype": dtype_name, "shapes": rows, "model_mix_gflops": model_mix, "peak_gflops": peak,
            "square_gemm": square}


def measure_bandwidth(mib: int, min_time: float) -> dict[str, float]:
    import torch

    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    read = _time(lambda: torch.sum(src), min_time)
    copy = _time(lambda: dst.copy_(src), min_time)
    nbytes = n * 4
    return {"bytes": nbytes, "read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9}


def utilisation(result: dict[str, Any], spec: ModelSpec, peaks: dict[str, float], bandwidth_gbs: float,
                default_dtype: str) -> dict[str, Any]:
    """MFU / MBU of one benchmark result (a dict from bench throughput / latency / serve)."""
    dtype = result.get("dtype") or default_dtype
    if dtype == "auto":
        dtype = default_dtype
    peak = peaks.get(dtype, 0.0) * 1e9
    nbytes = _DTYPE_BYTES.get(dtype, 2)
    kind = result.get("benchmark") or ("serve" if "request_throughput" in result else "throughput")
    out: dict[str, Any] = {"benchmark": kind, "backend": result.get("backend"), "dtype": dtype,
                           "peak_gflops": peak / 1e9, "bandwidth_gbs": bandwidth_gbs}
    if kind in ("throughput", "serve"):
        inputs = result.get("input_lens") or []
        outputs = result.get("output_lens") or []
        elapsed = result.get("elapsed_time") or result.get("duration")
        flops = sum(spec.request_flops(p, o) for p, o in zip(inputs, outputs) if o > 0)
        out.update(achieved_gflops=flops / elapsed / 1e9, mfu=flops / elapsed / peak if peak else None,
                   output_tokens_per_second=result.get("output_tokens_per_second", result.get("output_throughput")))
    elif kind == "latency":
        b, p, o = result["batch_size"], result["input_len"], result["output_len"]
        prefill = b * spec.prefill_flops(p) / result["prefill_time_s"]
        step_s = result["decode_token_latency_ms"]["mean"] / 1000.0
        context = p + o / 2.0
        decode_flops = b * spec.token_flops(context, logits=True) / step_s if step_s else 0.0
        step_bytes = spec.weight_bytes_per_step(nbytes) + b * context * spec.kv_bytes_per_token(nbytes)
        out.update(
            prefill_gflops=prefill / 1e9,
            prefill_mfu=prefill / peak if peak else None,
            decode_gflops=decode_flops / 1e9,
            decode_mfu=decode_flops / peak if peak else None,
            decode_bytes_per_step=step_bytes,
            decode_gbs=step_bytes / step_s / 1e9 if step_s else 0.0,
            decode_mbu=(step_bytes / step_s / 1e9) / bandwidth_gbs if step_s and bandwidth_gbs else None,
            decode_tokens_per_s=result.get("decode_tokens_per_s"),
            decode_tokens_per_s_bound=b * bandwidth_gbs * 1e9 / step_bytes,
        )
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (its config.json gives the shapes)")
    parser.add_argument("--dtype", default="auto",
                        help="dtype(s) to measure, comma-separated (auto = the engine's choice for the model)")
    parser.add_argument("--num-tokens", default="1,16,64,256", help="token counts M for the GEMMs")
    parser.add_argument("--square-size", type=int, default=2048, help="reference square GEMM (0 = skip)")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="size of the bandwidth test tensor")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per measurement")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--result-json", action="append", default=[],
                        help="benchmark result(s) to rate (repeatable)")
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_num_threads(args.num_threads)
    spec, config = load_spec(args.model)
    default_dtype = resolve_dtype_name("auto", config)
    dtypes = [resolve_dtype_name(d.strip(), config) for d in args.dtype.split(",") if d.strip()]
    results = [json.loads(Path(p).read_text()) for p in args.result_json]
    for r in results:
        d = r.get("dtype")
        d = default_dtype if d in (None, "auto") else d
        if d not in dtypes:
            dtypes.append(d)
    num_tokens = [int(m) for m in args.num_tokens.split(",") if m.strip()]
    gemms = {d: measure_gemms(spec, d, num_tokens, args.min_time, args.square_size) for d in dtypes}
    bandwidth = measure_bandwidth(args.bandwidth_mib, args.min_time)
    peaks = {d: g["peak_gflops"] for d, g in gemms.items()}
    rated = []
    for path, r in zip(args.result_json, results):
        entries = [r] + ([r["compare"]["hf"]] if isinstance(r.get("compare"), dict) and "hf" in r["compare"] else [])
        for entry in entries:
            u = utilisation(entry, spec, peaks, bandwidth["read_gbs"], default_dtype)
            u["file"] = path
            rated.append(u)
    bounds = {}
    for d, peak in peaks.items():
        nbytes = _DTYPE_BYTES[d]
        bounds[d] = {
            "compute_bound_tokens_per_s": peak * 1e9 / spec.token_flops(0, logits=True),
            "batch1_decode_bound_tokens_per_s": bandwidth["read_gbs"] * 1e9 / spec.weight_bytes_per_step(nbytes),
        }
    return {
        "benchmark": "roofline",
        "model": args.model,
        "params": spec.total_params,
        "layer_matmul_params": spec.layer_matmul_params,
        "lm_head_params": spec.lm_head_params,
        "gflop_per_token": spec.token_flops(0, logits=True) / 1e9,
        "gemm": gemms,
        "bandwidth": bandwidth,
        "bounds": bounds,
        "utilisation": rated,
        "machine": machine_info(),
    }


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_result(r: dict[str, Any]) -> None:
    print(f"Model {r['model']}: {r['params'] / 1e6:.1f}M parameters, "
          f"{r['gflop_per_token']:.4g} GFLOP per token (without attention)")
    for d, g in r["gemm"].items():
        print(f"--- {d} GEMM (GFLOP/s, best of repeats) ---")
        ms = sorted({row["M"] for row in g["shapes"]})
        print(f"{'shape':<14}{'K x N':>14}" + "".join(f"{'M=' + str(m):>10}" for m in ms))
        for name in dict.fromkeys(row["shape"] for row in g["shapes"]):
            rows = {row["M"]: row for row in g["shapes"] if row["shape"] == name}
            kn = f"{next(iter(rows.values()))['K']}x{next(iter(rows.values()))['N']}"
            print(f"{name:<14}{kn:>14}" + "".join(f"{rows[m]['gflops']:>10.1f}" for m in ms))
        print(f"{'model mix':<28}" + "".join(f"{g['model_mix_gflops'][str(m)]:>10.1f}" for m in ms))
        if g["square_gemm"]:
            s = g["square_gemm"]
            print(f"square GEMM {s['size']}^3: {s['gflops']:.1f} GFLOP/s")
        b = r["bounds"][d]
        print(f"bounds ({d}): compute {b['compute_bound_tokens_per_s']:.0f} tokens/s (peak {g['peak_gflops']:.0f} "
              f"GFLOP/s); batch-1 decode {b['batch1_decode_bound_tokens_per_s']:.1f} tokens/s (weights / bandwidth)")
    bw = r["bandwidth"]
    print(f"Memory: read {bw['read_gbs']:.1f} GB/s, copy {bw['copy_gbs']:.1f} GB/s ({bw['bytes'] / 2**20:.0f} MiB)")
    for u in r["utilisation"]:
        head = f"[{u['file']}] {u['benchmark']} ({u['backend']}, {u['dtype']}):"
        if u["benchmark"] == "latency":
            print(f"{head} prefill {u['prefill_gflops']:.1f} GFLOP/s = MFU {_pct(u['prefill_mfu'])}; decode "
                  f"{u['decode_gflops']:.1f} GFLOP/s = MFU {_pct(u['decode_mfu'])}, {u['decode_gbs']:.1f} GB/s = "
                  f"MBU {_pct(u['decode_mbu'])} (bound {u['decode_tokens_per_s_bound']:.1f} tokens/s, "
                  f"measured {u['decode_tokens_per_s']:.1f})")
        else:
            print(f"{head} {u['achieved_gflops']:.1f} GFLOP/s = MFU {_pct(u['mfu'])} "
                  f"({u['output_tokens_per_second']:.1f} output tokens/s)")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print_result(result)
    write_json(args.output_json, result)
    return 0
