"""vLLM's ``--dataset-name random-mm`` for ``bench serve``: the ``random`` dataset's prompts,
each with images of random pixels attached as OpenAI chat ``image_url`` parts (JPEG
``data:`` URLs, as vLLM's ``process_image`` writes them), for ``/v1/chat/completions``.

Options (vLLM's names and defaults):

- ``--random-mm-base-items-per-request n`` (1) and ``--random-mm-num-mm-items-range-ratio r``
  in [0, 1] (0): each request's item count is uniform in the integers
  ``[floor(n * (1 - r)), ceil(n * (1 + r))]``, the top clamped to the sum of the limits.
- ``--random-mm-limit-mm-per-prompt`` (JSON, ``{"image": 255, "video": 1}``): the most items
  of a modality in one request; once a request has that many, that modality's buckets are
  left out of its further draws.
- ``--random-mm-bucket-config`` (a Python literal: ``{(height, width, num_frames): p}``,
  default ``{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}``): each item's
  size is drawn with these probabilities, zero ones dropped and the rest normalised;
  ``num_frames`` 1 is an image. Videos (``num_frames`` > 1) are not generated yet (refused).

A request's ``prompt_len`` counts its text tokens only, as vLLM's: the tokens an image fills
are the served model's processor's business.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import math
from typing import Any

import numpy as np


Bucket = tuple[int, int, int]
DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 255, "video": 1}
DEFAULT_BUCKET_CONFIG: dict[Bucket, float] = {(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}


def parse_bucket_config(value: str) -> dict[Bucket, float]:
    """``--random-mm-bucket-config``'s text (a Python dict literal, tuple keys) -> the dict.

    Raises:
        argparse.ArgumentTypeError: not a dict of (height, width, num_frames) -> number.
    """
    try:
        parsed = ast.literal_eval(value) if isinstance(value, str) else value
    except (ValueError, SyntaxError) as exc:
        raise argparse.ArgumentTypeError(f"not a Python dict literal: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a dict {(height, width, num_frames): probability}")
    config = {}
    for key, probability in parsed.items():
        if isinstance(key, str):
            try:
                key = ast.literal_eval(key)
            except (ValueError, SyntaxError):
                pass
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(x, int) and x > 0 for x in key)):
            raise argparse.ArgumentTypeError(f"bucket {key!r} is not (height, width, num_frames) of positive ints")
        if not isinstance(probability, (int, float)) or probability < 0:
            raise argparse.ArgumentTypeError(f"bucket {key}: probability {probability!r} is not a number >= 0")
        config[key] = float(probability)
    return config


def add_random_mm_args(group: argparse._ArgumentGroup) -> None:
    """Add the ``random-mm`` options (see the module docstring) to ``group``."""
    group.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                       help="random-mm: images per request (mean)")
    group.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                       help="random-mm: items per request uniform in [n*(1-r), n*(1+r)], r in [0, 1]")
    group.add_argument("--random-mm-limit-mm-per-prompt", type=json.loads, default=dict(DEFAULT_LIMIT_MM_PER_PROMPT),
                       help='random-mm: most items per modality per request, JSON (e.g. \'{"image": 3}\')')
    group.add_argument("--random-mm-bucket-config", type=parse_bucket_config, default=dict(DEFAULT_BUCKET_CONFIG),
                       help="random-mm: {(height, width, num_frames): probability} of each item's size "
                            "(num_frames 1: an image)")


def _modality(bucket: Bucket) -> str:
    return "image" if bucket[2] == 1 else "video"


def _normalized(buckets: dict[Bucket, float]) -> dict[Bucket, float]:
    kept = {b: p for b, p in buckets.items() if p > 0}
    total = sum(kept.values())
    return {b: p / total for b, p in kept.items()}


def item_sampling(base_items: int, range_ratio: float, limits: dict[str, int],
                  buckets: dict[Bucket, float]) -> tuple[int, int, dict[Bucket, float]]:
    """(fewest, most items per request, the normalised buckets) of the options.

    Raises:
        ValueError: a ratio outside [0, 1]; no bucket of positive probability; a video bucket
            drawn; a bucket's modality without a limit; fewest above most.
    """
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {range_ratio}.")
    buckets = _normalized(buckets)
    if not buckets:
        raise ValueError("--random-mm-bucket-config has no bucket of positive probability.")
    videos = [b for b in buckets if _modality(b) == "video"]
    if videos:
        raise ValueError(f"--random-mm-bucket-config: video buckets {videos} are not supported yet "
                         "(num_frames 1 only).")
    missing = sorted({_modality(b) for b in buckets} - set(limits))
    if missing:
        raise ValueError(f"--random-mm-limit-mm-per-prompt has no limit for {missing[0]!r}, which the buckets draw.")
    used = {_modality(b) for b in buckets}
    most = min(sum(int(v) for k, v in limits.items() if k in used), math.ceil(base_items * (1 + range_ratio)))
    fewest = max(0, math.floor(base_items * (1 - range_ratio)))
    if fewest > most:
        raise ValueError(f"random-mm: at least {fewest} items per request, but at most {most} "
                         "(--random-mm-limit-mm-per-prompt).")
    return fewest, most, buckets


def draw_items(count: int, buckets: dict[Bucket, float], limits: dict[str, int],
               rng: np.random.Generator) -> list[Bucket]:
    """``count`` buckets drawn from ``buckets``' probabilities, a modality's buckets left out
    once ``limits`` of its items are drawn."""
    drawn: list[Bucket] = []
    per_modality = {_modality(b): 0 for b in buckets}
    left = dict(buckets)
    while len(drawn) < count and left:
        keys = list(left)
        bucket = keys[int(rng.choice(len(keys), p=list(left.values())))]
        modality = _modality(bucket)
        if per_modality[modality] < int(limits[modality]):
            per_modality[modality] += 1
            drawn.append(bucket)
        else:
            left = _normalized({b: p for b, p in left.items() if _modality(b) != modality})
    return drawn


def image_part(height: int, width: int, rng: np.random.Generator) -> dict[str, Any]:
    """An OpenAI chat ``image_url`` part: a ``height`` x ``width`` image of uniform random
    RGB pixels as a JPEG ``data:`` URL."""
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def attach_images(requests: list[Any], seed: int = 0, base_items_per_request: int = 1,
                  num_mm_items_range_ratio: float = 0.0, limit_mm_per_prompt: dict[str, int] | None = None,
                  bucket_config: dict[Bucket, float] | None = None) -> list[Any]:
    """``requests`` (``SampleRequest``s of the ``random`` dataset), each given
    ``multi_modal_data``: its ``image_url`` parts (see the module docstring), in place.
    Seeded: the same arguments give the same images.

    Raises:
        ValueError: see ``item_sampling``.
    """
    limits = dict(DEFAULT_LIMIT_MM_PER_PROMPT if limit_mm_per_prompt is None else limit_mm_per_prompt)
    fewest, most, buckets = item_sampling(base_items_per_request, num_mm_items_range_ratio, limits,
                                          DEFAULT_BUCKET_CONFIG if bucket_config is None else bucket_config)
    rng = np.random.default_rng([seed, 1])
    for request in requests:
        count = int(rng.integers(fewest, most + 1))
        request.multi_modal_data = [image_part(h, w, rng) for h, w, _ in draw_items(count, buckets, limits, rng)]
    return requests


def random_mm_description(args: argparse.Namespace) -> dict[str, Any]:
    """The ``random-mm`` options, for result JSON files (bucket keys as "(h, w, frames)" text)."""
    return {"random_mm_base_items_per_request": args.random_mm_base_items_per_request,
            "random_mm_num_mm_items_range_ratio": args.random_mm_num_mm_items_range_ratio,
            "random_mm_limit_mm_per_prompt": args.random_mm_limit_mm_per_prompt,
            "random_mm_bucket_config": {str(k): v for k, v in args.random_mm_bucket_config.items()}}
