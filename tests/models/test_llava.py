"""Llava (``LlavaForConditionalGeneration``): images through the checkpoint's own processor,
greedy output token-identical to transformers float32 ``generate`` on a tiny checkpoint, with
one image, two images of different sizes, and under both ``vision_feature_select_strategy``
values (the class token dropped or kept)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting
from tests.multimodal.checkpoints import hf_greedy, llava_checkpoint, random_image

MAX_TOKENS = 6
ONE_IMAGE = "<image> What is in this picture?"
TWO_IMAGES = "First <image> then <image>: compare them."


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_greedy_matches_transformers(tmp_path_factory, strategy):
    path = llava_checkpoint(tmp_path_factory, strategy)
    small, wide, other = random_image(40, 50, seed=1), random_image(64, 30, seed=2), random_image(40, 50, seed=3)
    cases = [(ONE_IMAGE, [small])]
    if strategy == "default":  # "full" changes the vision path only: one case shows it
        cases += [(TWO_IMAGES, [small, wide]), (ONE_IMAGE, [other])]
    expected = [hf_greedy(path, prompt, images, MAX_TOKENS) for prompt, images in cases]
    if strategy == "default":
        assert expected[0] != expected[2], "the image does not change the output: the test would not see a bug"
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": images if len(images) > 1 else images[0]}}
                            for p, images in cases], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    check_block_accounting(llm)
