"""Llama 4 (text): greedy token-identical to transformers (float32) under chunked prefill (steps
crossing chunk boundaries), preemption and prefix caching, on a checkpoint of three chunked
rope layers (24-token chunks, L2 q/k norms, llama3 rope) and one NoPE layer (temperature
tuning that the prompts' positions reach), dense and expert layers interleaved, on each attention
backend; its stacked experts load as transformers holds them, and an image-text checkpoint
serves its language model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from pagedllm.attention import selector
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.model_executor.layers.fused_moe.router import topk_sigmoid
from pagedllm.model_executor.models.llama4 import Llama4ForCausalLM
from tests.conftest import LLAMA3_ROPE_SCALING
from tests.helpers import cpu_only, float32_llm, model_runner
from tests.models.utils import SCENARIOS, assert_scenario, prompts_for

#: 4 layers: chunked, chunked, chunked, NoPE (no_rope_layer_interval 4); experts on layers 1
#: and 3. floor_scale 8: the NoPE layer's query scale grows from position 7 on.
CONFIG = dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
              intermediate_size_mlp=64, interleave_moe_layer_step=2, attention_chunk_size=24, head_dim=16,
              floor_scale=8, attn_scale=0.5, max_position_embeddings=256,
              rope_scaling={**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 32})


@pytest.fixture(scope="module")
def llama4(checkpoint_factory):
    return checkpoint_factory("Llama4ForCausalLM", seed=2, **CONFIG)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_transformers(llama4, scenario):
    llm = assert_scenario(llama4, scenario, prompts_for(1024))
    assert llm.llm_engine.engine_core.kv_cache_manager.block_pool.null_block is not None


def test_chunked_prefill_steps_cross_chunk_boundaries(llama4):
    """Steps of 20 tokens over 8-token blocks: prefill chunks end at 20, 40, 60 ... across the
    24-token attention chunks, and the decodes cross them too."""
    prompts = prompts_for(1024, lengths=(23, 50, 70), seed=11)
    assert_scenario(llama4, "chunked_prefill", prompts, max_tokens=12, max_num_batched_tokens=20)


@pytest.mark.parametrize("backend", ["TORCH_SDPA", pytest.param("CPU_ATTN", marks=cpu_only)])
@pytest.mark.parametrize("scenario", ["chunked_prefill", "prefix_caching"])
def test_each_attention_backend_equals_transformers(request, llama4, backend, scenario):
    """Both backends have chunked local attention (the C++ kernel's window starting at the
    query's chunk): the same greedy tokens on each."""
    if backend == "CPU_ATTN":
        request.getfixturevalue("kernel")
    llm = assert_scenario(llama4, scenario, prompts_for(1024), attention_backend=backend)
    assert model_runner(llm).attn_backend.get_name() == backend


def test_stacked_experts_load_transposed(llama4):
    """``experts.gate_up_proj`` [E, H, 2 x I] (gate columns first) and ``down_proj`` [E, I, H]
    land as FusedMoE's [E, 2 x I, H] / [E, H, I]; the shared expert and router load by name."""
    with selector.set_attn_backend(TorchSDPABackend):
        model = Llama4ForCausalLM(AutoConfig.from_pretrained(llama4))
    weights = load_file(llama4 / "model.safetensors")
    model.load_weights(weights.items())
    experts = model.model.layers[1].mlp.experts
    gate_up = weights["model.layers.1.feed_forward.experts.gate_up_proj"]
    assert torch.equal(experts.w13_weight.data, gate_up.transpose(1, 2))
    assert torch.equal(experts.w2_weight.data, weights["model.layers.1.feed_forward.experts.down_proj"].transpose(1, 2))
    assert torch.equal(model.model.layers[1].mlp.router.weight, weights["model.layers.1.feed_forward.router.weight"])
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape[0] == 2 * CONFIG["intermediate_size_mlp"]


def test_sigmoid_router_equals_transformers():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    router = Llama4Router(Llama4TextConfig(hidden_size=8, num_local_experts=5, num_experts_per_tok=1))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    scores, logits = router(x)
    weights, ids = topk_sigmoid(logits, 1)
    assert torch.equal(ids[:, 0], scores.argmax(dim=-1))
    assert torch.equal(weights[:, 0], scores.max(dim=-1).values)



@pytest.fixture(scope="module")
def llama4_image_text(llama4, tmp_path_factory):
    """A ``Llama4ForConditionalGeneration`` checkpoint written by transformers whose language
    model is ``llama4``'s (its weights copied in) beside a tiny vision tower and projector."""
    import shutil

    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = AutoConfig.from_pretrained(llama4).to_dict()
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = Llama4Config(text_config=text, vision_config=vision)
    config.architectures = ["Llama4ForConditionalGeneration"]
    model = Llama4ForConditionalGeneration(config).eval()
    missing, unexpected = model.language_model.load_state_dict(load_file(llama4 / "model.safetensors"), strict=False)
    assert not unexpected and not [m for m in missing if "lm_head" not in m]
    out = tmp_path_factory.mktemp("llama4-image-text")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(llama4 / name, out / name)
    return out


def test_image_text_checkpoint_serves_its_language_model(llama4, llama4_image_text):
    """The image-text checkpoint loads text-only (vision tensors skipped, ``language_model.``
    removed) and gives the text checkpoint's transformers greedy output under chunked prefill."""
    names = load_file(llama4_image_text / "model.safetensors").keys()
    assert any(n.startswith("vision_model.") for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)
    llm = float32_llm(llama4_image_text, SCENARIOS["chunked_prefill"])
    assert llm.llm_engine.model_config.architecture == "Llama4ForConditionalGeneration"
    assert_scenario(llama4, "chunked_prefill", prompts_for(1024), llm=llm)
