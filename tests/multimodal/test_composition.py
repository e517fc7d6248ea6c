"""Image prompts compose with the engine's other features, greedy output token-identical to
transformers' float32 ``generate`` on tiny image-text checkpoints: a LoRA adapter on the
language model of Llava, Qwen2.5-VL and Gemma 3 (the shared scenario, transformers + PEFT
merged as the reference; one adapting Llava's or Gemma 3's vision tower is refused),
speculative decoding with the n-gram proposer (Llava, Qwen2.5-VL) and with a text-only draft
model (Qwen2.5-VL's language model: drafts accepted, so the drafted tokens'
three-row positions count), EAGLE heads refused at load, and ``-tp 2`` (Llava's CLIP tower and
Qwen2.5-VL's vision tower split over two worker processes). Block and encoder-cache
accounting checked at the end."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.helpers import can_host_workers, check_block_accounting
from tests.multimodal.checkpoints import (
    gemma3_checkpoint,
    hf_greedy,
    hf_qwen_vl_greedy,
    llava_checkpoint,
    make_llava_checkpoint,
    make_qwen_vl_checkpoint,
    random_image,
)
from tests.multimodal.scenarios import check_lora_image_prompts, make_vl_adapter
from tests.spec_decode.test_spec_greedy_equality import record_spec_stats

MAX_TOKENS = 8
LLAVA_PROMPTS = ["<image> What is in this picture?", "First <image> then <image>: compare them."]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_PROMPTS = [f"{QWEN_IMAGE} What is in this picture?", f"First {QWEN_IMAGE} then {QWEN_IMAGE}: compare them."]
GEMMA3_PROMPTS = ["<start_of_image> What is in this picture?", "First <start_of_image> then <start_of_image>: compare."]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def images():
    return [random_image(40, 50, seed=1), random_image(64, 48, seed=2)]


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return make_qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))


def _requests(prompts: list[str], images: list) -> list[dict]:
    return [{"prompt": p, "multi_modal_data": {"image": images[: p.count("image")]}} for p in prompts]


def _generate(llm: LLM, prompts: list[str], images: list, lora_request=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(_requests(prompts, images), params, lora_request=lora_request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _check_accounting(llm: LLM) -> None:
    check_block_accounting(llm)
    manager = llm.llm_engine.engine_core.scheduler.encoder_cache_manager
    assert not any(manager.cached.values()), "an encoder-cache entry is still referenced"
    assert manager.num_free_slots + sum(manager.freeable.values()) == manager.cache_size


def _llava_expected(path, images) -> list[list[int]]:
    return [hf_greedy(path, p, images[: p.count("image")], MAX_TOKENS) for p in LLAVA_PROMPTS]


def _qwen_expected(path, images) -> list[list[int]]:
    return [hf_qwen_vl_greedy(path, p, images[: p.count("image_pad")], MAX_TOKENS) for p in QWEN_PROMPTS]


def test_llava_lora_matches_merged_transformers(tmp_path_factory, images):
    base = llava_checkpoint(tmp_path_factory)
    adapter, merged = make_vl_adapter(base, tmp_path_factory.mktemp("llava-lora"))
    llm = check_lora_image_prompts(base, adapter, merged, [(p, p.count("image")) for p in LLAVA_PROMPTS], images,
                                   lambda path: _llava_expected(path, images), MAX_TOKENS)
    # Names: PEFT adapts the CLIP tower's q_proj / v_proj too.
    vision, _ = make_vl_adapter(base, tmp_path_factory.mktemp("llava-vision-lora"), ["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="vision_tower.*is not supported"):
        _generate(llm, LLAVA_PROMPTS[:1], images, LoRARequest("vision", 2, str(vision)))
    _check_accounting(llm)


def test_qwen_vl_lora_matches_merged_transformers(tmp_path_factory, qwen_vl, images):
    adapter, merged = make_vl_adapter(qwen_vl, tmp_path_factory.mktemp("qwen2_5_vl-lora"))
    llm = check_lora_image_prompts(qwen_vl, adapter, merged, [(p, p.count("image_pad")) for p in QWEN_PROMPTS],
                                   images, lambda path: _qwen_expected(path, images), MAX_TOKENS, block_size=8)
    _check_accounting(llm)


def test_gemma3_lora_matches_merged_transformers(tmp_path_factory, images):
    base = gemma3_checkpoint(tmp_path_factory)
    adapter, merged = make_vl_adapter(base, tmp_path_factory.mktemp("gemma3-lora"))
    expected = lambda path: [hf_greedy(path, p, images[: p.count("image")], MAX_TOKENS) for p in GEMMA3_PROMPTS]
    llm = check_lora_image_prompts(base, adapter, merged, [(p, p.count("image")) for p in GEMMA3_PROMPTS], images,
                                   expected, MAX_TOKENS, block_size=8)
    # Names: PEFT adapts the SigLIP tower's q_proj / v_proj too.
    vision, _ = make_vl_adapter(base, tmp_path_factory.mktemp("gemma3-vision-lora"), ["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="vision_tower.*is not supported"):
        _generate(llm, GEMMA3_PROMPTS[:1], images, LoRARequest("vision", 2, str(vision)))
    _check_accounting(llm)


def test_llava_ngram_spec_decode_matches_transformers(tmp_path_factory, images):
    path = llava_checkpoint(tmp_path_factory)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, speculative_config=NGRAM,
              max_num_batched_tokens=16)
    stats = record_spec_stats(llm)
    assert _generate(llm, LLAVA_PROMPTS, images) == _llava_expected(path, images)
    assert stats.num_drafts > 0, stats
    _check_accounting(llm)


def test_qwen_vl_ngram_spec_decode_matches_transformers(qwen_vl, images):
    llm = LLM(str(qwen_vl), dtype="float32", kv_cache_memory_bytes=16 << 20, speculative_config=NGRAM,
              max_num_batched_tokens=16, block_size=8)
    stats = record_spec_stats(llm)
    assert _generate(llm, QWEN_PROMPTS, images) == _qwen_expected(qwen_vl, images)
    assert stats.num_drafts > 0, stats
    _check_accounting(llm)


def language_model_draft(vl_path, out):
    """The Qwen2.5-VL checkpoint's language model as a text-only ``Qwen2ForCausalLM`` (plain
    RoPE, no vision tower) with the checkpoint's tokenizer: a draft model that shares the
    target's vocabulary and, away from the images, most of its predictions."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    vl = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32)
    text = vl.config.text_config
    config = Qwen2Config(hidden_size=text.hidden_size, num_hidden_layers=text.num_hidden_layers,
                         num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                         intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
                         max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.rms_norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": text.rope_parameters["rope_theta"]},
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    draft = Qwen2ForCausalLM(config)
    draft.model.load_state_dict(vl.model.language_model.state_dict())
    draft.lm_head.load_state_dict(vl.lm_head.state_dict())
    draft.save_pretrained(out)
    AutoTokenizer.from_pretrained(vl_path).save_pretrained(out)
    return out


def test_qwen_vl_draft_model_spec_decode_matches_transformers(tmp_path_factory, qwen_vl, images):
    """A text-only draft model proposes without the images; the target verifies with them."""
    draft = language_model_draft(qwen_vl, tmp_path_factory.mktemp("qwen2_5_vl-draft"))
    llm = LLM(str(qwen_vl), dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=16, block_size=8,
              speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    stats = record_spec_stats(llm)
    assert _generate(llm, QWEN_PROMPTS, images) == _qwen_expected(qwen_vl, images)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    _check_accounting(llm)


@pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")
@pytest.mark.parametrize("model", ["llava", "qwen2_5_vl"])
def test_two_ranks_match_transformers(model, tmp_path_factory, qwen_vl, images):
    # Llava's vocabulary padded to an even size, so that two ranks split it.
    path = (make_llava_checkpoint(tmp_path_factory.mktemp("llava-even"), pad_vocab_to=2) if model == "llava"
            else qwen_vl)
    prompts, expected = ((LLAVA_PROMPTS, _llava_expected(path, images)) if model == "llava"
                         else (QWEN_PROMPTS, _qwen_expected(path, images)))
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20, block_size=8,
              max_num_batched_tokens=16)
    try:
        assert _generate(llm, prompts, images) == expected
        _check_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_head_with_image_text_model_refused_at_load(tmp_path_factory, method):
    path = llava_checkpoint(tmp_path_factory)
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"'{method}' is not supported yet with an image-text model "
                                         r"\(LlavaForConditionalGeneration"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, speculative_config=spec)
