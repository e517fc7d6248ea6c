"""``bench serve --dataset-name random-mm`` (vLLM's): random prompts with random images. The
dataset draws its item counts and sizes as its options say (seeded) and refuses what it
cannot send; against a real ``pagedllm serve`` of the tiny Llava every request completes with
the text runs' metrics, and the server saw each image's 16 tokens."""

from __future__ import annotations

import argparse
import base64
import io
import json
import re

import httpx
import pytest
from PIL import Image

from pagedllm.benchmarks.datasets import random_mm_dataset
from pagedllm.benchmarks.random_mm import parse_bucket_config
from pagedllm.benchmarks.serve import check_multimodal_args
from tests.benchmarks.test_bench_cli import pagedllm_parser, run_bench
from tests.multimodal.checkpoints import NUM_IMAGE_TOKENS, llava_checkpoint
from tests.server_utils import RemoteServer

BUCKETS = {(20, 30, 1): 3.0, (10, 12, 1): 1.0, (50, 50, 16): 0.0}


def _sizes(request) -> list[tuple[int, int]]:
    """(height, width) of each image of a request, decoded from its data: URL."""
    sizes = []
    for part in request.multi_modal_data:
        assert part["type"] == "image_url"
        header, data = part["image_url"]["url"].split(",", 1)
        assert header == "data:image/jpeg;base64"
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        sizes.append((image.height, image.width))
    return sizes


def test_random_mm_counts_and_sizes_follow_the_options(tokenizer):
    requests = random_mm_dataset(tokenizer, 200, 16, 4, base_items_per_request=2, num_mm_items_range_ratio=0.5,
                                 limit_mm_per_prompt={"image": 2}, bucket_config=BUCKETS, seed=3)
    counts = [len(r.multi_modal_data) for r in requests]
    assert set(counts) == {1, 2}  # [floor(2 * 0.5), ceil(2 * 1.5)] = [1, 3], clamped to the limit 2
    sizes = [size for r in requests for size in _sizes(r)]
    assert set(sizes) == {(20, 30), (10, 12)}
    assert abs(sizes.count((20, 30)) / len(sizes) - 0.75) < 0.1
    assert {r.prompt_len for r in requests} == {16} and {r.expected_output_len for r in requests} == {4}
    again = random_mm_dataset(tokenizer, 200, 16, 4, base_items_per_request=2, num_mm_items_range_ratio=0.5,
                              limit_mm_per_prompt={"image": 2}, bucket_config=BUCKETS, seed=3)
    assert [r.multi_modal_data for r in again] == [r.multi_modal_data for r in requests]
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]
    none = random_mm_dataset(tokenizer, 5, 16, 4, base_items_per_request=0, bucket_config=BUCKETS)
    assert all(r.multi_modal_data == [] for r in none)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bucket_config": {(8, 8, 4): 1.0}, "limit_mm_per_prompt": {"video": 1}}, "video buckets"),
    ({"bucket_config": {(8, 8, 1): 0.0}}, "no bucket of positive probability"),
    ({"num_mm_items_range_ratio": 1.5}, r"in \[0, 1\]"),
    ({"limit_mm_per_prompt": {"video": 1}}, "no limit for 'image'"),
    ({"base_items_per_request": 4, "limit_mm_per_prompt": {"image": 2}, "num_mm_items_range_ratio": 0.0},
     "at least 4 items per request, but at most 2"),
])  # fmt: skip
def test_random_mm_refuses_what_it_cannot_send(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        random_mm_dataset(tokenizer, 2, 8, 2, **kwargs)


def test_random_mm_cli_options_and_endpoint():
    args = pagedllm_parser().parse_args([
        "bench", "serve", "--dataset-name", "random-mm", "--random-mm-bucket-config", "{(32, 48, 1): 1}",
        "--random-mm-limit-mm-per-prompt", '{"image": 3}', "--random-mm-base-items-per-request", "2",
        "--random-mm-num-mm-items-range-ratio", "0.5"])  # fmt: skip
    assert args.random_mm_bucket_config == {(32, 48, 1): 1.0} and args.random_mm_limit_mm_per_prompt == {"image": 3}
    assert args.random_mm_base_items_per_request == 2 and args.random_mm_num_mm_items_range_ratio == 0.5
    with pytest.raises(ValueError, match="use --endpoint /v1/chat/completions"):
        check_multimodal_args(args)  # the default endpoint is /v1/completions
    with pytest.raises(argparse.ArgumentTypeError, match="not .height, width, num_frames."):
        parse_bucket_config("{(32, 48): 1}")
    with pytest.raises(SystemExit):  # the offline benchmarks take no images
        pagedllm_parser().parse_args(["bench", "throughput", "--dataset-name", "random-mm"])


def _prompt_tokens_total(server: RemoteServer) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^pagedllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_random_mm_against_a_real_llava_server(tmp_path_factory, tmp_path, tokenizer):
    path = llava_checkpoint(tmp_path_factory)
    options = ["--dataset-name", "random-mm", "--num-prompts", "6", "--random-input-len", "12",
               "--random-output-len", "4", "--random-mm-base-items-per-request", "1",
               "--random-mm-num-mm-items-range-ratio", "1", "--random-mm-limit-mm-per-prompt", '{"image": 2}',
               "--random-mm-bucket-config", "{(40, 50, 1): 0.5, (64, 48, 1): 0.5}", "--seed", "2"]
    server = RemoteServer(path, "--served-model-name", "llava", "--limit-mm-per-prompt", '{"image": 2}')
    try:
        out = tmp_path / "serve.json"
        rc = run_bench(["serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions", *options,
                        "--max-concurrency", "3", "--ignore-eos", "--num-warmups", "0", "--disable-tqdm",
                        "--output-json", str(out)])  # fmt: skip
        assert rc == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 6 and not any(result["errors"]), result["errors"]
        assert result["total_output_tokens"] == 6 * 4 and result["output_lens"] == [4] * 6
        assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] and result["mean_tpot_ms"] > 0
        assert result["dataset_name"] == "random-mm"
        assert result["random_mm_bucket_config"] == {"(40, 50, 1)": 0.5, "(64, 48, 1)": 0.5}
        # The same images again (their draws do not depend on the tokenizer): the bench's text
        # tokens plus each image's 16 reached the server.
        args = pagedllm_parser().parse_args(["bench", "serve", *options])
        requests = random_mm_dataset(tokenizer, 6, 12, 4, seed=2, base_items_per_request=1,
                                     num_mm_items_range_ratio=1.0, limit_mm_per_prompt={"image": 2},
                                     bucket_config=args.random_mm_bucket_config)
        num_images = sum(len(r.multi_modal_data) for r in requests)
        assert num_images > 0
        assert _prompt_tokens_total(server) >= result["total_input_tokens"] + NUM_IMAGE_TOKENS * num_images
    finally:
        server.close()
