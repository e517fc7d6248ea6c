"""The encoder cache's accounting and the scheduling of encoder inputs, on plain requests (no
model): items shared by content hash, kept while referenced, evicted oldest first when room is
needed (and reported once), a step stopped before an image that does not fit its budget, and
(``disable_chunked_mm_input``) before one it would not reach the end of."""

from __future__ import annotations

from pagedllm.core.encoder_cache_manager import (
    EncoderCacheManager,
    free_computed_encoder_inputs,
    schedule_encoder_inputs,
)
from pagedllm.core.request import Request
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedllm.sampling_params import SamplingParams


def _request(req_id: str, images: list[tuple[str, int, int]], num_tokens: int = 64) -> Request:
    """A request of ``num_tokens`` tokens with images (hash, offset, length)."""
    features = [MultiModalFeatureSpec("image", h, PlaceholderRange(offset, length)) for h, offset, length in images]
    return Request(EngineCoreRequest(req_id, [5] * num_tokens, SamplingParams(max_tokens=1), None, 0.0,
                                     mm_features=features), max_model_len=128)


def test_items_are_shared_kept_and_evicted_oldest_first():
    manager = EncoderCacheManager(cache_size=32)
    a, b = _request("a", [("x", 2, 16)]), _request("b", [("x", 4, 16), ("y", 30, 16)])
    manager.allocate(a, 0)
    assert manager.check_and_update_cache(b, 0)  # same content: no second encoder run
    manager.allocate(b, 1)
    assert manager.num_free_slots == 0 and not manager.can_allocate(1)
    manager.free(a)
    assert not manager.can_allocate(1), "an entry another request still needs became evictable"
    manager.free(b)
    c = _request("c", [("z", 0, 16)])
    assert manager.can_allocate(16)
    manager.allocate(c, 0)
    assert manager.get_freed_mm_hashes() == ["x"] and manager.get_freed_mm_hashes() == []
    assert set(manager.cached) == {"y", "z"}


def test_a_step_stops_before_an_image_past_its_budget():
    manager = EncoderCacheManager(cache_size=32)
    request = _request("r", [("x", 4, 16), ("y", 24, 16)])
    # Budget 20: the first image runs, the step ends where the second begins.
    to_run, num_new, budget = schedule_encoder_inputs(manager, request, 0, 48, 20)
    assert (to_run, num_new, budget) == ([0], 24, 4)
    for i in to_run:
        manager.allocate(request, i)
    # A later chunk inside the first image: its embeddings are cached, nothing runs again.
    assert schedule_encoder_inputs(manager, request, 8, 8, 0) == ([], 8, 0)
    request.num_computed_tokens = 24
    free_computed_encoder_inputs(manager, request)
    assert manager.freeable == {"x": 16}
    # The second image with no budget left: no token of it runs this step.
    assert schedule_encoder_inputs(manager, request, 24, 8, 0) == ([], 0, 0)
    assert schedule_encoder_inputs(manager, request, 24, 16, 16) == ([1], 16, 0)


def test_the_same_image_twice_in_one_step_is_one_entry():
    manager = EncoderCacheManager(cache_size=32)
    request = _request("r", [("x", 0, 16), ("x", 20, 16)])
    to_run, num_new, _ = schedule_encoder_inputs(manager, request, 0, 40, 32)
    for i in to_run:
        manager.allocate(request, i)
    assert num_new == 40 and manager.num_free_slots == 16
    request.num_computed_tokens = 40
    free_computed_encoder_inputs(manager, request)
    assert manager.freeable == {"x": 16} and manager.num_free_slots + 16 == manager.cache_size


def test_disable_chunked_mm_input_never_ends_a_step_inside_an_image():
    manager = EncoderCacheManager(cache_size=32)
    request = _request("r", [("x", 4, 16), ("y", 24, 16)])
    # 12 tokens would end inside the first image: the step stops before it (4 text tokens).
    assert schedule_encoder_inputs(manager, request, 0, 12, 32, disable_chunked_mm_input=True) == ([], 4, 32)
    # 30 tokens: the first image whole, the step stops where the second begins.
    assert schedule_encoder_inputs(manager, request, 0, 30, 32, disable_chunked_mm_input=True) == ([0], 24, 16)
    # Starting inside an image (a prefix-cache hit) and not reaching its end: no token runs.
    assert schedule_encoder_inputs(manager, request, 8, 8, 32, disable_chunked_mm_input=True) == ([], 0, 32)
    assert schedule_encoder_inputs(manager, request, 8, 12, 32, disable_chunked_mm_input=True) == ([0], 12, 16)
    # Without the option the same step cuts the image.
    assert schedule_encoder_inputs(manager, request, 0, 12, 32) == ([0], 12, 16)
