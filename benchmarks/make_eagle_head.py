"""Write a random EAGLE / EAGLE-3 head for a benchmark checkpoint (no downloads).

    python benchmarks/make_eagle_head.py --target benchmarks/checkpoints/qwen2-0.5b-shape --method eagle \
        --out benchmarks/checkpoints/qwen2-0.5b-eagle-head
    python benchmarks/make_eagle_head.py --target benchmarks/checkpoints/qwen2-0.5b-shape --method eagle3 \
        --out benchmarks/checkpoints/qwen2-0.5b-eagle3-head --draft-vocab-size 8000

The layout is the published heads' (``tests.fixtures.eagle_heads.make_eagle_head``); its
random proposals are (almost) never accepted, so a run with it measures what drafting costs
(the "random draft" line of docs/benchmarks.md). An EAGLE-3 head reads target layers
(2, L // 2, L - 3), vLLM's default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# tests/fixtures is in the checkout, not in the package (and pagedllm too, when not installed).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.fixtures.eagle_heads import make_eagle_head  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    """Parse the command line, write the head, print a one-line summary, return its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target checkpoint's folder")
    parser.add_argument("--method", required=True, choices=["eagle", "eagle3"])
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="EAGLE-3: tokens of the head's own vocabulary (default: half the target's)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = make_eagle_head(args.out, args.target, args.method, seed=args.seed, draft_vocab_size=args.draft_vocab_size)
    weight_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote a random {args.method} head for {args.target} to {out}: "
          f"{weight_bytes / 1e6:.1f} MB of weights in {time.perf_counter() - start:.1f} s")
    return out


if __name__ == "__main__":
    main()
