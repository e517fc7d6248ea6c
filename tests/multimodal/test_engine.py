"""Images through the engine's scheduling regimes, greedy output token-identical to
transformers float32 on the tiny Llava checkpoint, each scenario ending with the block and
encoder-cache accounting checks:

- chunked prefill with 8-token steps: each image's 16 placeholder tokens run over several
  chunks, from one encoder run per image (the encoder cache keeps its embeddings);
- preemption: too few blocks for the batch, requests recomputed (their images encoded again
  or found in the encoder cache);
- prefix caching: the same image and text hit the cache and give the same tokens; another image
  with the same text hits nothing (its blocks are keyed by the image's content hash).
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import check_block_accounting, model_runner
from tests.multimodal.checkpoints import hf_greedy, llava_checkpoint, random_image

MAX_TOKENS = 5
ONE_IMAGE = "<image> What is in this picture?"
TWO_IMAGES = "First <image> then <image>: compare them."
#: Bytes of one KV block of the tiny model at block size 8 (2 layers, K and V, 2 heads of 16, float32).
BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return llava_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def images():
    return [random_image(40, 50, seed=1), random_image(64, 30, seed=2), random_image(50, 50, seed=3)]


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def _generate(llm: LLM, prompts: list[dict], max_tokens: int = MAX_TOKENS) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _count_encoder_runs(llm: LLM) -> list[int]:
    """A one-element list counting the vision encoder's images from now on."""
    model = model_runner(llm).model
    runs, encode = [0], model.get_multimodal_embeddings

    def counting(pixel_values):
        runs[0] += pixel_values.shape[0]
        return encode(pixel_values)

    model.get_multimodal_embeddings = counting
    return runs


def _check_accounting(llm: LLM) -> None:
    """Blocks, and no encoder-cache entry still referenced once every request finished."""
    check_block_accounting(llm)
    manager = llm.llm_engine.engine_core.scheduler.encoder_cache_manager
    assert not any(manager.cached.values()), "an encoder-cache entry is still referenced"
    assert manager.num_free_slots + sum(manager.freeable.values()) == manager.cache_size


def test_chunked_prefill_runs_each_image_once(path, images):
    prompts = [_prompt(ONE_IMAGE, [images[0]]), _prompt(TWO_IMAGES, images[:2])]
    expected = [hf_greedy(path, p["prompt"], p["multi_modal_data"]["image"], MAX_TOKENS) for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=8, kv_cache_memory_bytes=4 << 20)
    runs = _count_encoder_runs(llm)
    assert [list(o.outputs[0].token_ids) for o in _generate(llm, prompts)] == expected
    assert runs[0] == 2, "an image was encoded again for a later chunk of its tokens"  # images[0] is shared
    _check_accounting(llm)


def test_preemption_recomputes_with_images(path, images):
    # Two of these (42 prompt tokens, 12 outputs: 7 blocks each) outgrow the 12 blocks while decoding.
    prompts = [_prompt(TWO_IMAGES, [images[i], images[(i + 1) % 3]]) for i in range(3)]
    expected = [hf_greedy(path, p["prompt"], p["multi_modal_data"]["image"], 12) for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=8, max_model_len=96, enable_prefix_caching=False,
              kv_cache_memory_bytes=12 * BLOCK_BYTES)
    assert [list(o.outputs[0].token_ids) for o in _generate(llm, prompts, 12)] == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the scenario did not preempt"
    _check_accounting(llm)


def test_prefix_cache_keys_blocks_by_image(path, images):
    same, other = _prompt(ONE_IMAGE, [images[0]]), _prompt(ONE_IMAGE, [images[2]])
    expected_same = hf_greedy(path, ONE_IMAGE, [images[0]], MAX_TOKENS)
    expected_other = hf_greedy(path, ONE_IMAGE, [images[2]], MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", block_size=8, enable_prefix_caching=True, kv_cache_memory_bytes=4 << 20)
    first, = _generate(llm, [same])
    again, = _generate(llm, [same])
    changed, = _generate(llm, [other])
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == expected_same
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16, "the same image and text did not hit"
    assert list(changed.outputs[0].token_ids) == expected_other
    assert changed.num_cached_tokens == 0, "another image with the same text hit the first image's blocks"
    _check_accounting(llm)
