"""Placeholder runs that hold tokens besides the image token (Pixtral's [IMG_BREAK] after each
row and [IMG_END] last): the range covers the whole run and flags the image-token positions
(``is_embed``); a chunk of the run takes the right slice of the image's embeddings at the right
positions; the encoder cache and the encoder budget count embeddings, not run tokens; the flags
survive the engine's msgpack encoding; a Pixtral image's largest embedding count comes from its
processor's longest edge; a run that does not match its image is refused."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from pagedllm.core.encoder_cache_manager import EncoderCacheManager, schedule_encoder_inputs
from pagedllm.core.request import Request
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.multimodal.budget import max_tokens_per_mm_item
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedllm.multimodal.processing import placeholder_ranges
from pagedllm.sampling_params import SamplingParams

IMG, BREAK, END, TEXT = 7, 8, 9, 5


def _run(rows: int, cols: int) -> list[int]:
    tokens = ([IMG] * cols + [BREAK]) * rows
    tokens[-1] = END
    return tokens


def test_a_run_with_breaks_is_one_range_flagging_its_image_tokens():
    tokens = [TEXT, *_run(2, 3), TEXT, TEXT, *_run(3, 1), TEXT]
    first, second = placeholder_ranges(tokens, IMG, [8, 6], (BREAK, END))
    assert (first.offset, first.length, first.num_embeds) == (1, 8, 6)
    assert first.is_embed == (True, True, True, False, True, True, True, False)
    assert (second.offset, second.length, second.num_embeds) == (11, 6, 3)
    # Without run tokens (Llava) a range has no flags and every position takes an embedding.
    (plain,) = placeholder_ranges([TEXT, IMG, IMG, TEXT], IMG, [2])
    assert plain.is_embed is None and plain.num_embeds == 2


def test_a_chunk_takes_the_embeddings_of_its_image_tokens_only():
    run = PlaceholderRange(10, 8, (True, True, True, False, True, True, True, False))
    assert run.embeds_in(0, 100) == ([10, 11, 12, 14, 15, 16], 0, 6)
    assert run.embeds_in(12, 15) == ([12, 14], 2, 4)  # cut mid-row, across the break
    assert run.embeds_in(13, 14) == ([], 3, 3)  # the break alone
    assert run.embeds_in(18, 30) == ([], 0, 0)
    assert PlaceholderRange(4, 3).embeds_in(5, 20) == ([5, 6], 1, 3)


def test_the_encoder_cache_and_budget_count_embeddings():
    position = PlaceholderRange(2, 8, (True, True, True, False, True, True, True, False))
    request = Request(EngineCoreRequest("r", [TEXT] * 16, SamplingParams(max_tokens=1), None, 0.0,
                                        mm_features=[MultiModalFeatureSpec("image", "x", position)]), max_model_len=64)
    manager = EncoderCacheManager(cache_size=6)
    assert schedule_encoder_inputs(manager, request, 0, 16, 6) == ([0], 16, 0)  # 6 embeddings fit 6
    manager.allocate(request, 0)
    assert manager.num_free_slots == 0
    manager.free(request)
    assert manager.freeable == {"x": 6}


def test_a_pixtral_image_is_at_most_its_longest_edge_in_embeddings():
    config = SimpleNamespace(architectures=["Mistral3ForConditionalGeneration"], spatial_merge_size=2,
                             vision_config={"patch_size": 14, "image_size": 1540})
    assert max_tokens_per_mm_item(config) == 55**2  # 1540 pixels a side, 28 per embedding
    assert max_tokens_per_mm_item(config, mm_processor_kwargs={"size": {"longest_edge": 560}}) == 20**2


def test_the_flags_survive_the_engine_encoding():
    feature = MultiModalFeatureSpec("image", "x", PlaceholderRange(1, 3, (True, False, True)))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(feature), type=MultiModalFeatureSpec)
    assert decoded == feature and decoded.mm_position.num_embeds == 2


@pytest.mark.parametrize(("tokens", "lengths", "reason"), [
    ([TEXT, *_run(2, 3), TEXT], [6], "placeholder tokens for 1 image"),  # a run of 8 said to be 6
    ([TEXT, IMG, IMG, TEXT, IMG, END], [4], "not contiguous"),
])
def test_a_run_that_does_not_match_its_image_is_refused(tokens, lengths, reason):
    with pytest.raises(ValueError, match=reason):
        placeholder_ranges(tokens, IMG, lengths, (BREAK, END))
