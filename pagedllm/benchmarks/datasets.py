"""Synthetic benchmark datasets with vLLM's names: ``random`` and ``prefix_repetition``;
``repeat``, an input-grounded task for speculative decoding; and for ``bench serve``,
``random-mm`` (``pagedllm.benchmarks.random_mm``: random prompts with random images).

Prompts are lists of token ids drawn (seeded, with numpy) uniformly from the tokenizer's
vocabulary without its special tokens, so a prompt is exactly as long as asked and no
engine stops early on an EOS in the prompt. Where a server needs text (``bench serve``),
:func:`to_text_prompt` decodes the ids and adjusts them until the text re-encodes to the
requested length, as vLLM's ``gen_prompt_decode_to_target_len`` does.

Options (as vLLM's ``vllm bench``):

- ``--dataset-name random``: ``--random-input-len`` (alias ``--input-len``),
  ``--random-output-len`` (alias ``--output-len``), ``--random-range-ratio r``: each
  request's input and output lengths are drawn uniformly from the integers in
  ``[floor(len * (1 - r)), ceil(len * (1 + r))]``; ``--random-prefix-len`` adds one shared
  random prefix of that many tokens to every prompt.
- ``--dataset-name prefix_repetition``: ``--num-prefixes`` distinct random prefixes of
  ``--prefix-len`` tokens (vLLM: ``--prefix-repetition-prefix-len`` ...), each followed by
  a random suffix of ``--suffix-len`` tokens; requests cycle through the prefixes and are
  then shuffled; output length ``--prefix-repetition-output-len`` (default: the output
  length above).
- ``--dataset-name repeat`` (pagedllm's): real text that the model is led to repeat, where
  n-gram speculation (prompt lookup) finds its drafts. Each prompt is a passage of Python
  standard-library documentation (docstrings; it starts at a paragraph chosen by the seed)
  of ``--input-len`` tokens minus the cue, a blank line, and the passage's first
  ``REPEAT_CUE_TOKENS`` tokens again (the cue), so the likeliest continuation is the rest
  of the passage.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from pagedllm.benchmarks import random_mm

DATASET_NAMES = ("random", "prefix_repetition", "repeat")
#: The datasets whose requests carry images (``SampleRequest.multi_modal_data``): chat servers only.
MULTIMODAL_DATASET_NAMES = ("random-mm",)
#: Tokens of the passage repeated after the blank line (the cue to continue copying it).
REPEAT_CUE_TOKENS = 8
_REPEAT_SOURCES = ("argparse", "collections", "json", "re", "string", "textwrap", "urllib.parse")


@dataclass
class SampleRequest:
    """One benchmark request: prompt token ids, their count, and how many tokens to generate.

    ``prompt`` is text for servers (set by :func:`to_text_prompt`), else None.
    ``multi_modal_data``: OpenAI chat content parts (``image_url``) sent after the text, or
    None (a text-only request); ``prompt_len`` counts the text alone.
    """

    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: Optional[str] = None
    prompt_len: int = field(default=-1)
    multi_modal_data: Optional[list[dict[str, Any]]] = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_token_ids)


def add_dataset_args(parser: argparse.ArgumentParser, *, default_input_len: int = 1024,
                     default_output_len: int = 128, seed: bool = True, multimodal: bool = False) -> None:
    """Add vLLM's dataset options (random and prefix_repetition) and ``repeat`` to ``parser``;
    ``seed=False`` leaves out ``--seed`` (a benchmark whose engine flags declare it: the
    engine's seed is then the dataset's too); ``multimodal`` adds ``random-mm`` and its
    options (a benchmark that sends chat requests with images)."""
    group = parser.add_argument_group("dataset")
    names = DATASET_NAMES + (MULTIMODAL_DATASET_NAMES if multimodal else ())
    group.add_argument("--dataset-name", default="random", choices=names,
                       help="synthetic dataset (default: random)")
    group.add_argument("--num-prompts", type=int, default=1000, help="number of requests")
    group.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int,
                       default=default_input_len, help="prompt tokens per request (mean)")
    group.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int,
                       default=default_output_len, help="output tokens per request (mean)")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths")
    group.add_argument("--random-prefix-len", type=int, default=0,
                       help="tokens of one random prefix shared by every random prompt")
    group.add_argument("--prefix-repetition-prefix-len", "--prefix-len", dest="prefix_len", type=int,
                       default=256, help="prefix_repetition: tokens per shared prefix")
    group.add_argument("--prefix-repetition-suffix-len", "--suffix-len", dest="suffix_len", type=int,
                       default=256, help="prefix_repetition: tokens of each request's own suffix")
    group.add_argument("--prefix-repetition-num-prefixes", "--num-prefixes", dest="num_prefixes", type=int,
                       default=10, help="prefix_repetition: number of distinct prefixes")
    group.add_argument("--prefix-repetition-output-len", dest="prefix_output_len", type=int, default=None,
                       help="prefix_repetition: output tokens (default: --output-len)")
    if seed:
        group.add_argument("--seed", type=int, default=0, help="dataset (and sampling) seed")
    if multimodal:
        random_mm.add_random_mm_args(group)


def sample_lengths(mean_len: int, range_ratio: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """``num`` integers uniform in ``[floor(mean_len*(1-r)), ceil(mean_len*(1+r))]`` (at least 1).

    Raises:
        ValueError: if ``range_ratio`` is outside ``[0, 1)`` or ``mean_len`` < 1.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    if mean_len < 1:
        raise ValueError(f"lengths must be at least 1 token, got {mean_len}.")
    low = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Token ids to draw prompts from: the tokenizer's vocabulary less its special tokens."""
    vocab_size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to draw prompts from")
    return ids


def _draw(vocab: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    if n <= 0:
        return []
    return vocab[rng.integers(0, vocab.size, size=n)].tolist()


def random_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's ``random`` dataset: random token ids, lengths uniform within ``range_ratio``."""
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    input_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    prefix = _draw(vocab, prefix_len, rng)
    return [
        SampleRequest(prefix + _draw(vocab, int(i), rng), int(o))
        for i, o in zip(input_lens, output_lens)
    ]


def prefix_repetition_dataset(tokenizer: Any, num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """vLLM's ``prefix_repetition``: ``num_prefixes`` shared prefixes, each request a prefix plus
    its own random suffix; shuffled.

    Raises:
        ValueError: if ``num_prefixes`` < 1.
    """
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be at least 1, got {num_prefixes}.")
    rng = np.random.default_rng(seed)
    vocab = allowed_token_ids(tokenizer)
    prefixes = [_draw(vocab, prefix_len, rng) for _ in range(num_prefixes)]
    requests = [
        SampleRequest(prefixes[i % num_prefixes] + _draw(vocab, suffix_len, rng), output_len)
        for i in range(num_prompts)
    ]
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def _documentation_paragraphs() -> list[str]:
    """Paragraphs of the docstrings of ``_REPEAT_SOURCES`` and their public functions and
    classes (in a fixed order), license texts left out."""
    import importlib
    import inspect

    docs = []
    for name in _REPEAT_SOURCES:
        module = importlib.import_module(name)
        docs.append(module.__doc__ or "")
        docs += [inspect.getdoc(getattr(module, attr)) or "" for attr in sorted(dir(module)) if not attr.startswith("_")]
    paragraphs = [p.strip() for doc in docs for p in doc.split("\n\n")]
    return [p for p in paragraphs if len(p) >= 80 and "LICENSE" not in p.upper() and "DAMAGE" not in p.upper()]


def repeat_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                   seed: int = 0) -> list[SampleRequest]:
    """The ``repeat`` dataset (see the module docstring): ``input_len``-token prompts asking,
    by their form, for a passage to be repeated. Passages start at a paragraph.

    Raises:
        ValueError: if ``input_len`` leaves no room for a passage (at most 2 x
            ``REPEAT_CUE_TOKENS``).
    """
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    passage_len = input_len - len(sep) - REPEAT_CUE_TOKENS
    if passage_len <= REPEAT_CUE_TOKENS:
        raise ValueError(f"--input-len must exceed {2 * REPEAT_CUE_TOKENS + len(sep)} for the repeat dataset.")
    ids: list[int] = []
    starts = []
    for paragraph in _documentation_paragraphs():
        starts.append(len(ids))
        ids += tokenizer.encode(paragraph, add_special_tokens=False) + sep
    starts = [start for start in starts if start + passage_len <= len(ids)] or [0]
    ids = ids * (1 + passage_len // len(ids))
    rng = np.random.default_rng(seed)
    requests = []
    for start in rng.choice(starts, size=num_prompts).tolist():
        passage = ids[start : start + passage_len]
        requests.append(SampleRequest(passage + sep + passage[:REPEAT_CUE_TOKENS], output_len))
    return requests


def random_mm_dataset(tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                      prefix_len: int = 0, seed: int = 0, base_items_per_request: int = 1,
                      num_mm_items_range_ratio: float = 0.0, limit_mm_per_prompt: Optional[dict[str, int]] = None,
                      bucket_config: Optional[dict] = None) -> list[SampleRequest]:
    """vLLM's ``random-mm``: the ``random`` dataset's requests, each with random images as
    ``image_url`` parts (``pagedllm.benchmarks.random_mm``). Seeded.

    Raises:
        ValueError: see ``random_mm.item_sampling``.
    """
    requests = random_dataset(tokenizer, num_prompts, input_len, output_len, range_ratio, prefix_len, seed)
    return random_mm.attach_images(requests, seed, base_items_per_request, num_mm_items_range_ratio,
                                   limit_mm_per_prompt, bucket_config)


def get_samples(args: argparse.Namespace, tokenizer: Any, num_prompts: Optional[int] = None,
                seed: Optional[int] = None) -> list[SampleRequest]:
    """The requests that ``args`` (from :func:`add_dataset_args`) describe."""
    num = args.num_prompts if num_prompts is None else num_prompts
    seed = args.seed if seed is None else seed
    if args.dataset_name == "random":
        return random_dataset(tokenizer, num, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.random_prefix_len, seed)
    if args.dataset_name == "prefix_repetition":
        output_len = args.prefix_output_len or args.random_output_len
        return prefix_repetition_dataset(tokenizer, num, args.prefix_len, args.suffix_len,
                                         args.num_prefixes, output_len, seed)
    if args.dataset_name == "repeat":
        return repeat_dataset(tokenizer, num, args.random_input_len, args.random_output_len, seed)
    if args.dataset_name == "random-mm":
        return random_mm_dataset(tokenizer, num, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.random_prefix_len, seed,
                                 args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio,
                                 args.random_mm_limit_mm_per_prompt, args.random_mm_bucket_config)
    raise ValueError(f"unknown --dataset-name {args.dataset_name!r}; choose one of {DATASET_NAMES}")


def dataset_description(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset options, for result JSON files."""
    desc: dict[str, Any] = {"dataset_name": args.dataset_name, "seed": args.seed}
    if args.dataset_name in ("random", "random-mm"):
        desc.update(random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                    random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len)
    elif args.dataset_name == "repeat":
        desc.update(input_len=args.random_input_len, output_len=args.random_output_len)
    else:
        desc.update(prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                    output_len=args.prefix_output_len or args.random_output_len)
    if args.dataset_name == "random-mm":
        desc.update(random_mm.random_mm_description(args))
    return desc


def to_text_prompt(tokenizer: Any, request: SampleRequest, rng: np.random.Generator,
                   vocab: Optional[np.ndarray] = None, max_retries: int = 10) -> SampleRequest:
    """A copy of ``request`` with ``prompt`` text that re-encodes to (about) ``prompt_len`` tokens.

    Decoding random ids and encoding the text again seldom gives the same ids; as vLLM does,
    the ids are cut or extended with random tokens and decoded again, up to ``max_retries``
    times. ``prompt_len`` and ``prompt_token_ids`` are those of the final text's encoding.
    """
    target = len(request.prompt_token_ids)
    vocab = allowed_token_ids(tokenizer) if vocab is None else vocab
    ids = list(request.prompt_token_ids)
    text = tokenizer.decode(ids)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(max_retries):
        if len(encoded) == target:
            break
        if len(encoded) > target:
            ids = encoded[:target]
        else:
            ids = encoded + _draw(vocab, target - len(encoded), rng)
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
    return SampleRequest(list(encoded), request.expected_output_len, prompt=text, prompt_len=len(encoded),
                         multi_modal_data=request.multi_modal_data)


def length_stats(values: Sequence[int]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"min": 0, "max": 0, "mean": 0.0}
    return {"min": int(arr.min()), "max": int(arr.max()), "mean": float(arr.mean())}
