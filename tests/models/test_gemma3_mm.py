"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) on a tiny checkpoint with its own
processor, in one engine with 24-token steps (prompts run in chunks that never cut an image)
and prefix caching: greedy output token-identical to transformers float32 with one image, two
images of different sizes and a text-only prompt; the two-image prompt's logprobs within 1e-3
of transformers' (they move by up to 0.07 when an image's tokens attend causally only, which
greedy tokens of this model do not show); the same image again hits the prefix cache, another
image with the same text hits nothing; then the block and encoder-cache accounting checks."""

from __future__ import annotations

from tests.multimodal.checkpoints import NUM_IMAGE_TOKENS, gemma3_checkpoint, hf_greedy, hf_log_softmax, random_image
from tests.multimodal.scenarios import check_caches_released, check_image_prompts


def test_gemma3_images_match_transformers(tmp_path_factory):
    images = (random_image(40, 50, seed=1), random_image(64, 30, seed=2), random_image(50, 50, seed=3))
    llm, _ = check_image_prompts(gemma3_checkpoint(tmp_path_factory), hf_greedy, hf_log_softmax,
                                 "Describe <start_of_image>", "Compare <start_of_image> and <start_of_image>",
                                 images, min_cached=NUM_IMAGE_TOKENS)
    check_caches_released(llm)
