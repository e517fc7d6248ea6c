"""The start-up memory profile counts the vision encoder: ``ModelRunner.profile_run`` runs the
encoder once, on the largest image the limits allow (its embeddings as many as
``max_tokens_per_mm_item``: Qwen2.5-VL's processor's ``max_pixels``, the checkpoint's and under
``--mm-processor-kwargs``; Mistral 3's longest edge; Llava's and Gemma 3's fixed size), and
its peak, in bytes, enters the result where it is above the language model's."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.multimodal.budget import max_tokens_per_mm_item
from pagedllm.platforms import current_platform
from tests.multimodal.checkpoints import (
    gemma3_checkpoint,
    llava_checkpoint,
    make_qwen_vl_checkpoint,
    mistral3_checkpoint,
)

#: What the wrapped encoder holds while it runs: far above the tiny language model's peak.
ENCODER_BYTES = 256 << 20


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_executor.driver_worker.model_runner


def _profile_with_heavy_encoder(llm: LLM, monkeypatch) -> tuple[int, int, list[dict], list[int]]:
    """(the language model's profile alone, ``profile_run``'s, the encoder's inputs, its
    outputs' embedding counts) with the model's ``get_multimodal_embeddings`` holding
    ``ENCODER_BYTES`` of written memory as it runs. (The KV cache is replaced by the
    profile's: call it last.)"""
    runner = _runner(llm)
    model = runner.model
    calls: list[dict] = []
    counts: list[int] = []
    original = model.get_multimodal_embeddings

    def heavy(**inputs):
        calls.append(inputs)
        activations = torch.ones(ENCODER_BYTES // 4, dtype=torch.float32, device=runner.device)
        out = original(**inputs)
        counts.append(out.shape[1])
        return out + activations[:1].sum() * 0

    monkeypatch.setattr(model, "get_multimodal_embeddings", heavy)
    with torch.inference_mode():
        language = current_platform.profile_activation_peak(runner._dummy_run,
                                                            runner.scheduler_config.max_num_batched_tokens)
    return language, runner.profile_run(), calls, counts


def _largest_image_tokens(llm: LLM, mm_processor_kwargs=None) -> int:
    config = llm.llm_engine.model_config
    return max_tokens_per_mm_item(config.hf_config, config.model_dir, mm_processor_kwargs)


@pytest.mark.parametrize("max_pixels", [None, 64 * 64])
def test_qwen_vl_profile_runs_encoder_on_largest_image(tmp_path_factory, monkeypatch, max_pixels):
    path = make_qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))
    kwargs = {"mm_processor_kwargs": {"max_pixels": max_pixels}} if max_pixels else {}
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=64, **kwargs)
    language, profiled, calls, counts = _profile_with_heavy_encoder(llm, monkeypatch)
    assert len(calls) == 1
    (t, h, w), = calls[0]["image_grid_thw"].tolist()
    # The checkpoint's 96 x 96 pixels: 36 tokens; 64 x 64 under max_pixels: 16.
    assert counts == [t * h * w // 4] == [_largest_image_tokens(llm, kwargs.get("mm_processor_kwargs"))]
    assert counts == [16 if max_pixels else 36]
    assert language < ENCODER_BYTES <= profiled, (language, profiled)


@pytest.mark.parametrize("checkpoint", [llava_checkpoint, gemma3_checkpoint, mistral3_checkpoint])
def test_profile_runs_encoder_on_largest_image(tmp_path_factory, monkeypatch, checkpoint):
    llm = LLM(str(checkpoint(tmp_path_factory)), dtype="float32", kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=64)
    language, profiled, calls, counts = _profile_with_heavy_encoder(llm, monkeypatch)
    assert counts == [_largest_image_tokens(llm)]
    assert language < ENCODER_BYTES <= profiled, (language, profiled)
