"""Every config key of each registered architecture is classified (honoured or behaviour-free),
and a config setting a key the model code would ignore is refused at load."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from pagedllm import LLM
from pagedllm.arch_config import (
    ARCH_CONFIG,
    BEHAVIOUR_FREE_KEYS,
    ENGINE_KEYS,
    check_hf_config,
    language_model_config,
    layer_attention_chunk_sizes,
    layer_sliding_windows,
)
from pagedllm.model_executor.models.registry import MODEL_REGISTRY


def _config(architecture: str, **kwargs):
    return AutoConfig.for_model(ARCH_CONFIG[architecture].model_type, architectures=[architecture],
                                num_hidden_layers=2, **kwargs)


def test_every_registered_architecture_states_its_keys():
    assert set(ARCH_CONFIG) == set(MODEL_REGISTRY)


@pytest.mark.parametrize("architecture", sorted(MODEL_REGISTRY))
def test_every_config_key_is_classified(architecture):
    """A key transformers adds to the config class fails here until it is classified."""
    arch = ARCH_CONFIG[architecture]
    keys = set(AutoConfig.for_model(arch.model_type).to_dict())
    unclassified = keys - arch.honoured - BEHAVIOUR_FREE_KEYS - ENGINE_KEYS
    assert not unclassified, f"{architecture}: classify {sorted(unclassified)} in pagedllm.arch_config"
    assert not arch.honoured & BEHAVIOUR_FREE_KEYS
    check_hf_config(_config(architecture))  # the defaults are served


@pytest.mark.parametrize(
    ("architecture", "kwargs", "message"),
    [
        ("LlamaForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5}}, "rope type .proportional."),
        ("Qwen2ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}},
         "rope_parameters: partial_rotary_factor 0.5 is not built"),
        ("LlamaForCausalLM", {"sliding_window": 16}, "sliding_window=16 .*attends over the whole context"),
        ("MistralForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
        ("MistralForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor.0.5"),
        ("MistralForCausalLM", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
        ("Qwen2ForCausalLM", {"attention_bias": True}, "attention_bias=True"),
        ("Qwen2ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
        ("Qwen3ForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ("Gemma3ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("Olmo2ForCausalLM", {"logits_scaling": 2.0}, "logits_scaling=2.0"),
        ("Phi3ForCausalLM", {"attention_multiplier": 0.5}, "attention_multiplier=0.5"),
        ("BertModel", {"is_decoder": True}, "is_decoder=True"),
        ("RobertaModel", {"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
        ("Llama4ForCausalLM", {"layer_types": ["chunked_attention", "sliding_attention"]},
         r"layer_types \['sliding_attention'\]"),
        ("Llama4ForCausalLM", {"layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": None},
         "attention_chunk_size=None for chunked_attention layers"),
    ],
)
def test_unread_config_keys_are_refused(architecture, kwargs, message):
    with pytest.raises(ValueError, match=f"{architecture} model sets what pagedllm does not build: .*{message}"):
        check_hf_config(_config(architecture, **kwargs))


@pytest.mark.parametrize(
    ("architecture", "kwargs", "windows"),
    [
        # Qwen2.5 / llamafied checkpoints: a window with use_sliding_window false is off.
        ("LlamaForCausalLM", {"sliding_window": 4096, "use_sliding_window": False}, [None, None]),
        ("MistralForCausalLM", {"sliding_window": None}, [None, None]),
        ("MistralForCausalLM", {"sliding_window": 8}, [8, 8]),
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 1}, [None, None]),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [None, 8]),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, [8, 8]),
        ("Phi3ForCausalLM", {"sliding_window": 8}, [8, 8]),
        ("Gemma3ForCausalLM", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, [8, None]),
        ("Gemma3ForConditionalGeneration", {"sliding_window": 8}, [8, 8]),  # 1 full layer in 6 by default
        ("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, [None, None]),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, [None, None]),
        ("GptOssForCausalLM", {"sliding_window": 8}, [8, None]),  # alternating from its default layer_types
    ],
)
def test_accepted_configs_and_their_windows(architecture, kwargs, windows):
    config = _config(architecture, **kwargs)
    check_hf_config(config)
    assert layer_sliding_windows(config) == windows


def test_checkpoint_with_unread_key_is_refused_at_load(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM", attn_logit_softcapping=50.0, seed=41)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 \\(LlamaForCausalLM's code does not read it\\)"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)


def test_image_text_checkpoint_is_served_by_its_text_config():
    config = AutoConfig.for_model("gemma3", architectures=["Gemma3ForConditionalGeneration"], tie_word_embeddings=False,
                                  text_config={"num_hidden_layers": 2, "sliding_window": 8}, dtype="bfloat16")
    text = language_model_config(config)
    assert text is config.text_config and text.model_type == "gemma3_text"
    assert text.architectures == ["Gemma3ForConditionalGeneration"] and text.tie_word_embeddings is False
    check_hf_config(text)
    assert layer_sliding_windows(text) == [8, 8]
    llama = _config("LlamaForCausalLM")
    assert language_model_config(llama) is llama


@pytest.mark.parametrize(
    ("kwargs", "chunks"),
    [
        ({"attention_chunk_size": 8, "no_rope_layer_interval": 2}, [8, None]),  # NoPE layers attend fully
        ({"attention_chunk_size": None}, [None, None]),  # no chunk: every layer full
        ({"attention_chunk_size": 8, "layer_types": ["full_attention", "chunked_attention"]}, [None, 8]),
    ],
)
def test_llama4_layers_attend_in_chunks_by_layer_types(kwargs, chunks):
    config = _config("Llama4ForCausalLM", **kwargs)
    check_hf_config(config)
    assert layer_attention_chunk_sizes(config) == chunks and layer_sliding_windows(config) == [None, None]
    assert layer_attention_chunk_sizes(_config("MistralForCausalLM", sliding_window=8)) == [None, None]
