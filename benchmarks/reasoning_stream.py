"""Front-end cost of ``--reasoning-parser gpt_oss`` on a stream: seconds to feed one long harmony
output through ``ReasoningStream`` one token a feed (as the server streams it), reading the text
alone and reading the token ids (the tokenizer with gpt-oss's special tokens).

    python benchmarks/reasoning_stream.py [--repeats 400] [--runs 3]

Prints a markdown table: output tokens, seconds per stream (best of ``--runs``) for each way.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# tests/fixtures is in the checkout, not in the package (and pagedllm too, when not installed).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from pagedllm.reasoning import ReasoningParserManager, ReasoningStream  # noqa: E402
from pagedllm.reasoning.harmony_tokens import MARKERS  # noqa: E402
from tests.fixtures.checkpoints import build_tokenizer  # noqa: E402


def harmony_output(tokenizer, repeats: int) -> list[int]:
    """Token ids of an analysis message (``repeats`` sentences) then a short final one."""
    segments = ["<|channel|>", "analysis", "<|message|>", "The quick brown fox jumps over the lazy dog. " * repeats,
                "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Done.", "<|return|>"]
    ids: list[int] = []
    for segment in segments:
        if segment in MARKERS:
            ids.append(tokenizer.convert_tokens_to_ids(segment))
        else:
            ids += tokenizer.encode(segment, add_special_tokens=False, split_special_tokens=True)
    return ids


def stream_seconds(tokenizer, ids: list[int], texts: list[str], by_ids: bool) -> float:
    parser = ReasoningParserManager.get_reasoning_parser("gpt_oss")({})
    stream = ReasoningStream(parser, tokenizer if by_ids else None)
    start, previous = time.perf_counter(), ""
    for k, text in enumerate(texts):
        stream.feed(text[len(previous):], k == len(ids) - 1, ids[k : k + 1])
        previous = text
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=400, help="sentences in the analysis message")
    parser.add_argument("--runs", type=int, default=3, help="streams per way; the best is reported")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *MARKERS]})
    ids = harmony_output(tokenizer, args.repeats)
    texts = [tokenizer.decode(ids[: k + 1], skip_special_tokens=False).rstrip("\ufffd") for k in range(len(ids))]
    print("| output tokens | reading | s per stream (best of %d) |" % args.runs)
    print("|---|---|---|")
    for label, by_ids in (("text", False), ("token ids", True)):  # alternated in one process
        best = min(stream_seconds(tokenizer, ids, texts, by_ids) for _ in range(args.runs))
        print(f"| {len(ids)} | {label} | {best:.3f} |")


if __name__ == "__main__":
    main()
