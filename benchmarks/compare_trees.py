"""Compare two git revisions of pagedllm on the same workloads, alternating in one invocation.

A refactor that must not change speed is measured here: each round runs every workload on
the base revision and on the new one (the order flips every round, so neither always runs
first on a warm or cold machine), and the table gives the median of each, their ratio, and
each tree's spread against itself ((max - min) / median of its rounds): a ratio inside the
spreads is noise.

    .venv/bin/python benchmarks/compare_trees.py --base 2083eec --new HEAD --rounds 3 \\
        --output-json benchmarks/results/seams.json

Each revision is checked out as a ``git worktree`` under a temporary directory and run from
there with this interpreter's site-packages (``python -S`` plus ``PYTHONPATH``, so the
editable install of the working tree does not shadow it). Workloads (bf16, 2 threads, a
4 GB KV cache):

- ``qwen-32x128``: ``bench throughput`` on ``benchmarks/checkpoints/qwen2-0.5b-shape``,
  32 prompts x 128 in / 128 out, ``--ignore-eos``: output tokens/s.
- ``qwen-b1``: ``bench latency`` on the 0.5B shape, batch 1, 128 in / 128 out: decode
  tokens/s (1000 / mean decode-token latency in ms).
- ``tiny-256``: ``bench throughput`` on ``benchmarks/checkpoints/tiny-llama``, 256 x
  128/128, ``--ignore-eos``: output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import site
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = ROOT / "benchmarks" / "checkpoints"

WORKLOADS: dict[str, tuple[list[str], str]] = {
    "qwen-32x128": (
        ["throughput", "--model", str(CHECKPOINTS / "qwen2-0.5b-shape"), "--num-prompts", "32",
         "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos"],
        "output_tokens_per_second",
    ),
    "qwen-b1": (
        ["latency", "--model", str(CHECKPOINTS / "qwen2-0.5b-shape"), "--batch-size", "1",
         "--input-len", "128", "--output-len", "128", "--num-iters", "2", "--num-iters-warmup", "1"],
        "decode_tokens_per_second",
    ),
    "tiny-256": (
        ["throughput", "--model", str(CHECKPOINTS / "tiny-llama"), "--num-prompts", "256",
         "--random-input-len", "128", "--random-output-len", "128", "--ignore-eos"],
        "output_tokens_per_second",
    ),
}


def _metric(result: dict, name: str) -> float:
    if name == "decode_tokens_per_second":
        return 1000.0 / result["decode_token_latency_ms"]["mean"]
    return result[name]


def spread_of(values: list[float]) -> float:
    """A tree's spread against itself: (max - min) / median of its rounds (0 for one round)."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def cli_module(tree: Path) -> str:
    """The module that runs the ``pagedllm`` command in ``tree`` (revisions differ)."""
    for module in ("pagedllm.cli.main", "pagedllm.entrypoints.cli"):
        if (tree / (module.replace(".", "/") + ".py")).is_file():
            return module
    return "pagedllm"


def run_once(tree: Path, workload: str, scratch: Path) -> float:
    """One ``pagedllm bench`` invocation of ``workload`` from the checkout ``tree``; returns
    its metric (tokens/s)."""
    args, metric = WORKLOADS[workload]
    out = scratch / f"{tree.name}-{workload}.json"
    env_path = f"{tree}:{':'.join(site.getsitepackages())}"
    command = [sys.executable, "-S", "-m", cli_module(tree), "bench", *args,
               "--dtype", "bfloat16", "--num-threads", "2", "--kv-cache-memory-bytes", "4000000000",
               "--output-json", str(out)]
    done = subprocess.run(command, cwd=scratch, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return _metric(json.loads(out.read_text()), metric)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision measured as the baseline")
    parser.add_argument("--new", default="HEAD", help="git revision measured against it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    results: dict[str, dict[str, list[float]]] = {w: {"base": [], "new": []} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        trees = {}
        for label, rev in (("base", args.base), ("new", args.new)):
            trees[label] = scratch / label
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                            str(trees[label]), rev], check=True)
        try:
            for round_index in range(args.rounds):
                order = ("base", "new") if round_index % 2 == 0 else ("new", "base")
                for workload in workloads:
                    for label in order:
                        value = run_once(trees[label], workload, scratch)
                        results[workload][label].append(value)
                        print(f"round {round_index + 1} {workload} {label}: {value:.2f} tok/s", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    summary = {}
    print(f"\n| workload | base {args.base} | new {args.new} | new / base | spread base | spread new |"
          "\n|---|---|---|---|---|---|")
    for workload, runs in results.items():
        base, new = statistics.median(runs["base"]), statistics.median(runs["new"])
        spread = {label: spread_of(runs[label]) for label in ("base", "new")}
        summary[workload] = {**runs, "median_base": base, "median_new": new, "ratio": new / base,
                             "spread_base": spread["base"], "spread_new": spread["new"]}
        print(f"| {workload} | {base:.2f} | {new:.2f} | {new / base:.3f} | "
              f"{spread['base']:.1%} | {spread['new']:.1%} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
