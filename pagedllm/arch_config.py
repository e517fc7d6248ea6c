"""What each architecture's model code reads of config.json, and the load-time refusal of
what it would ignore.

transformers' modeling code is the reference: a config key changes the output only where
that code reads it. For each registered architecture, ``ARCH_CONFIG`` states the keys of
its transformers config class (``AutoConfig.for_model(model_type).to_dict()``) that
pagedllm's model code honours, and the values of them that are built (``hidden_act``
"silu", Gemma's ``hidden_activation`` of ``GELU_ACTIVATIONS``, the rope types of ``ROPE_TYPES``,
layer kinds "full_attention" / "sliding_attention", causal attention only). A key transformers'
code keeps but never applies (Gemma 3's ``attn_logit_softcapping``) is honoured by ignoring it alike.
``BEHAVIOUR_FREE_KEYS`` are the keys no forward pass depends on (ids, labels, training
settings). ``FOREIGN_KEYS`` are keys other architectures read (soft-capping, multipliers):
a config.json that sets one to a non-neutral value asks for math the code does not do.

An image-text checkpoint of ``IMAGE_TEXT_ARCHITECTURES`` is served whole: its code reads
``language_model_config``, config.json's ``text_config`` with the vision tower's keys
(``vision_config`` ...) carried onto it. One of ``BIDIRECTIONAL_IMAGE_ARCHITECTURES`` attends
both ways inside each image's tokens. One of ``TEXT_ONLY_ARCHITECTURES`` (Llama 4's) is served
by its language model alone, from the same ``text_config``.

``check_hf_config`` refuses, with a message naming the key, a config that sets a key to a
value the code would silently ignore or misread; ``layer_sliding_windows`` is each layer's
attention window (transformers' semantics: a query at position i sees keys i - W + 1 .. i);
``layer_attention_chunk_sizes`` each layer's chunked local attention (Llama 4's
``attention_chunk_size``); ``state_layer_indices`` the layers that keep a recurrent state instead of a KV cache
(Mamba-2, gated delta rule: transformers' ``layer_types`` entry "linear_attention").

``get_rope_parameters`` is a layer's rope parameters read from either generation of config
(transformers 5's ``rope_parameters``, flat or keyed by layer type; 4.x's ``rope_scaling`` /
``rope_theta``), and ``rope_context_len`` the context length a rope scaling allows.

Plain Python (no torch): ``EngineArgs`` checks configs before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

#: Keys of the transformers config classes that no forward pass depends on.
BEHAVIOUR_FREE_KEYS = frozenset({
    "transformers_version", "_name_or_path", "model_type",
    "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward",  # transformers computes the feed-forward in chunks: same values
    "is_encoder_decoder",
    "id2label", "label2id", "problem_type",  # labels (a classifier's names and activation: read by the engine)
    "initializer_range", "use_cache",
    "attention_dropout",  # dropout is off at inference
    "pad_token_id",  # the embedding's padding_idx only masks its gradient
    "bos_token_id", "eos_token_id",  # stop tokens: the engine reads them (generation config)
    "pretraining_tp",  # not read by transformers' Llama since 4.4x: a split matmul, same math
    "_sliding_window_pattern",  # Gemma 3: the config expands it into layer_types at construction
    "resid_pdrop", "embd_pdrop",  # Phi-3's dropouts: off at inference
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",  # MoE training: aux loss, noise
    "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",  # BERT's dropouts: off at inference
    # Mamba-2's initialisation of dt_bias and of the residual projections (training only;
    # ``time_step_min`` is Nemotron-H's dt floor too, so each architecture classifies it).
    "time_step_rank", "time_step_max", "time_step_floor", "rescale_prenorm_residual",
    "num_logits_to_keep", "z_loss_coefficient",  # Bamba: logits kept by generate; a training loss
    # ModernBERT: initialisation, dropouts, flash-attention determinism, the masked-LM's
    # sparse training loss, special-token ids (the tokenizer's)
    "initializer_cutoff_factor", "embedding_dropout", "mlp_dropout", "deterministic_flash_attn",
    "sparse_prediction", "sparse_pred_ignore_index", "cls_token_id", "sep_token_id",
})

#: Keys read by the engine rather than by the model code (the class, the dtype).
ENGINE_KEYS = frozenset({"architectures", "dtype"})

_LLAMA_FAMILY_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_parameters", "head_dim",
})
_WINDOW_KEYS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
#: Qwen2-MoE / Qwen3-MoE: which layers hold experts, and their routing.
_QWEN_MOE_KEYS = frozenset({
    "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
})

#: Qwen3-Next / Qwen3.5: the Gated DeltaNet layers' shapes, and which layers they are.
_QWEN3_NEXT_KEYS = _LLAMA_FAMILY_KEYS | {
    "attention_bias", "layer_types", "partial_rotary_factor", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
}

#: Bamba's Mamba-2 mixers (Bamba, Granite 4): their shapes, and which layers they are.
_BAMBA_MIXER_KEYS = frozenset({
    "layer_types", "time_step_limit", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
    "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias",
})

#: DeepSeek-V2 / V3: multi-head latent attention, and the DeepSeekMoE layers and routing.
_DEEPSEEK_KEYS = frozenset({
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim",
    "attention_bias", "first_k_dense_replace", "moe_layer_freq", "n_routed_experts", "n_shared_experts",
    "moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
    "norm_topk_prob",  # V3's router renormalises with it; transformers' V2 router does not read it
})

#: Rope types ``RotaryEmbedding`` builds (transformers' ``ROPE_INIT_FUNCTIONS`` of the same names).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
#: Keys each rope type reads with no default (transformers' compute functions index them).
_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
#: Rope types whose parameters carry the pretraining context length.
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")
#: Gemma's ``hidden_activation`` values built -> ``GeluAndMul``'s ``approximate`` (transformers'
#: ``gelu_pytorch_tanh`` is the tanh approximation, ``gelu`` the exact form).
GELU_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
#: ``layer_types`` entries the attention layers build.
LAYER_TYPES = ("full_attention", "sliding_attention")
#: ``layer_types`` of an architecture with chunked local attention (``ArchConfig.windows`` "chunked").
CHUNKED_LAYER_TYPES = ("full_attention", "chunked_attention")
#: The ``layer_types`` entry of a layer that keeps a recurrent state (transformers' name for
#: Mamba-2 and gated delta rule layers).
STATE_LAYER_TYPE = "linear_attention"
#: The ``layer_types`` entry of a layer whose attention and Mamba-2 mixer run side by side
#: (transformers' Falcon-H1): a KV cache and a recurrent state.
HYBRID_LAYER_TYPE = "hybrid"
#: ``layer_types`` entries of layers that keep no cache at all (Nemotron-H's MLP and routed-expert layers).
CACHELESS_LAYER_TYPES = ("mlp", "moe")


@dataclass(frozen=True)
class ArchConfig:
    """One architecture's contract with its config.

    Attributes:
        model_type: the transformers ``model_type`` whose config class it reads.
        honoured: keys of that class the model code reads (``ENGINE_KEYS`` aside).
        windows: how layers get a sliding window: "none" (every layer attends over the whole
            context, as transformers' Llama), "all" (``sliding_window`` on every layer, None:
            none; Mistral), "layer_types" (``sliding_window`` on the layers whose
            ``layer_types`` entry is "sliding_attention"; Qwen2 / Qwen3), "bidirectional" (the
            model code masks its "sliding_attention" layers itself, both ways; ModernBERT, an
            encoder: no KV-cache windows), "chunked" (no window: chunked local attention of
            ``attention_chunk_size`` on the layers whose ``layer_types`` entry is
            "chunked_attention", full attention on the others; Llama 4).
        state_layers: which layers keep a recurrent state: "none", or "layer_types" (those
            whose ``layer_types`` entry is ``STATE_LAYER_TYPE``: every layer of Mamba-2, the
            layers outside ``attn_layer_indices`` of Bamba; or ``HYBRID_LAYER_TYPE``, beside
            their attention's KV cache: every layer of Falcon-H1).
        built_values: (key, the values built) of keys whose other values are refused;
            with ``hidden_act`` among them, it replaces the decoders' "silu" only rule.
    """

    model_type: str
    honoured: frozenset[str]
    windows: str
    state_layers: str = "none"
    built_values: tuple[tuple[str, tuple[Any, ...]], ...] = ()


_GEMMA_KEYS = (_LLAMA_FAMILY_KEYS - {"hidden_act"}) | {
    "hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window", "layer_types",
    "use_bidirectional_attention",  # built: false (causal); true is refused
}

#: BERT-style encoders (``pagedllm.model_executor.models.bert``): ``pad_token_id`` (behaviour-free
#: above) also places RoBERTa's positions; ``tie_word_embeddings``: no LM head, nothing to tie.
_ENCODER_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
    "max_position_embeddings", "layer_norm_eps", "type_vocab_size", "is_decoder", "add_cross_attention",
    "tie_word_embeddings",
})
_ENCODER_BUILT = (
    ("hidden_act", ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")),  # transformers' ACT2FN, as its code
    ("is_decoder", (None, False)),  # bidirectional attention
    ("add_cross_attention", (None, False)),
    ("position_embedding_type", (None, "absolute")),
)

#: ModernBERT (``pagedllm.model_executor.models.modernbert``): ``local_attention`` on the
#: "sliding_attention" layers, rope per layer type; the classifier's head keys; ``decoder_bias``
#: (the masked-LM decoder's, not built) and ``tie_word_embeddings`` (no LM head) change nothing.
_MODERNBERT_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "hidden_activation", "max_position_embeddings", "norm_eps", "norm_bias", "attention_bias", "mlp_bias",
    "layer_types", "rope_parameters", "local_attention", "classifier_pooling", "classifier_bias",
    "classifier_activation", "decoder_bias", "tie_word_embeddings",
})

#: Llama 4's text config (``Llama4TextConfig``): the layers' kinds, rope, norms and experts.
_LLAMA4_TEXT_KEYS = _LLAMA_FAMILY_KEYS | {
    "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers", "interleave_moe_layer_step",
    "use_qk_norm", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "layer_types",
    "attn_temperature_tuning", "floor_scale", "attn_scale", "attention_bias",
}

ARCH_CONFIG: dict[str, ArchConfig] = {
    "LlamaForCausalLM": ArchConfig("llama", _LLAMA_FAMILY_KEYS | {"attention_bias", "mlp_bias"}, "none"),
    "MistralForCausalLM": ArchConfig("mistral", _LLAMA_FAMILY_KEYS | {"sliding_window"}, "all"),
    "Qwen2ForCausalLM": ArchConfig("qwen2", _LLAMA_FAMILY_KEYS | _WINDOW_KEYS, "layer_types"),
    "Qwen3ForCausalLM": ArchConfig("qwen3", _LLAMA_FAMILY_KEYS | _WINDOW_KEYS | {"attention_bias"}, "layer_types"),
    "Olmo2ForCausalLM": ArchConfig("olmo2", _LLAMA_FAMILY_KEYS | {"attention_bias"}, "none"),
    "Gemma2ForCausalLM": ArchConfig(
        "gemma2", _GEMMA_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"}, "layer_types"),
    # attn_logit_softcapping: transformers' Gemma 3 keeps it in its attention layers and never
    # applies it; ignored here alike.
    "Gemma3ForCausalLM": ArchConfig(
        "gemma3_text", _GEMMA_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"}, "layer_types"),
    # The language model of a Gemma 3 image-text checkpoint (``language_model_config``):
    # transformers' Gemma3ForConditionalGeneration applies no final_logit_softcapping; ignored alike.
    "Gemma3ForConditionalGeneration": ArchConfig(
        "gemma3_text", _GEMMA_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"}, "layer_types"),
    # The Llama language model of a Llava checkpoint (``language_model_config``: its
    # ``text_config``, with ``IMAGE_TEXT_ARCHITECTURES``' vision keys carried onto it).
    "LlavaForConditionalGeneration": ArchConfig("llama", _LLAMA_FAMILY_KEYS | {"attention_bias", "mlp_bias"}, "none"),
    # The Mistral language model of a Mistral 3 (Pixtral vision tower) checkpoint.
    "Mistral3ForConditionalGeneration": ArchConfig("mistral", _LLAMA_FAMILY_KEYS | {"sliding_window"}, "all"),
    # The Qwen2 / Qwen3 language models of Qwen2.5-VL / Qwen3-VL (multimodal RoPE: the
    # ``mrope_section`` of their ``rope_parameters``).
    "Qwen2_5_VLForConditionalGeneration": ArchConfig(
        "qwen2_5_vl_text", _LLAMA_FAMILY_KEYS | _WINDOW_KEYS, "layer_types"),
    "Qwen3VLForConditionalGeneration": ArchConfig("qwen3_vl_text", _LLAMA_FAMILY_KEYS | {"attention_bias"}, "none"),
    "Phi3ForCausalLM": ArchConfig(
        "phi3", _LLAMA_FAMILY_KEYS | {"sliding_window", "original_max_position_embeddings", "partial_rotary_factor"},
        "all"),
    "Glm4ForCausalLM": ArchConfig("glm4", _LLAMA_FAMILY_KEYS | {"attention_bias", "partial_rotary_factor"}, "none"),
    "GraniteForCausalLM": ArchConfig("granite", _LLAMA_FAMILY_KEYS | {
        "attention_bias", "mlp_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
        "logits_scaling",
    }, "none"),
    # Mixture of experts: the Llama family's keys and the routing's.
    "MixtralForCausalLM": ArchConfig(
        "mixtral", _LLAMA_FAMILY_KEYS | {"sliding_window", "num_local_experts", "num_experts_per_tok"}, "all"
    ),
    "Qwen2MoeForCausalLM": ArchConfig(
        "qwen2_moe",
        _LLAMA_FAMILY_KEYS | _WINDOW_KEYS | _QWEN_MOE_KEYS | {"num_experts", "shared_expert_intermediate_size", "qkv_bias"},
        "layer_types",
    ),
    "Qwen3MoeForCausalLM": ArchConfig(
        "qwen3_moe",
        _LLAMA_FAMILY_KEYS | _QWEN_MOE_KEYS | {"num_local_experts", "attention_bias", "use_sliding_window", "sliding_window"},
        "all",
    ),
    "DeepseekV2ForCausalLM": ArchConfig(
        "deepseek_v2", _LLAMA_FAMILY_KEYS | _DEEPSEEK_KEYS | {"topk_method", "mlp_bias"}, "none"
    ),
    # ``num_nextn_predict_layers``: multi-token-prediction layers past the decoder, not run.
    "DeepseekV3ForCausalLM": ArchConfig(
        "deepseek_v3", _LLAMA_FAMILY_KEYS | _DEEPSEEK_KEYS | {"rope_interleave", "num_nextn_predict_layers"}, "none"
    ),
    "GptOssForCausalLM": ArchConfig(
        "gpt_oss",
        _LLAMA_FAMILY_KEYS | {"sliding_window", "layer_types", "attention_bias", "num_local_experts",
                              "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"},
        "layer_types",
    ),
    "BertModel": ArchConfig("bert", _ENCODER_KEYS, "none", built_values=_ENCODER_BUILT),
    "RobertaModel": ArchConfig("roberta", _ENCODER_KEYS, "none", built_values=_ENCODER_BUILT),
    "XLMRobertaModel": ArchConfig("xlm-roberta", _ENCODER_KEYS, "none", built_values=_ENCODER_BUILT),
    "ModernBertModel": ArchConfig("modernbert", _MODERNBERT_KEYS, "bidirectional"),
    "ModernBertForSequenceClassification": ArchConfig("modernbert", _MODERNBERT_KEYS, "bidirectional"),
    # State-space models (``MambaMixer2`` on the state cache). NOTE: ``residual_in_fp32`` is
    # read as vLLM reads it: the residual stays in the model dtype (the same in float32).
    "Mamba2ForCausalLM": ArchConfig("mamba2", frozenset({
        "num_heads", "head_dim", "vocab_size", "hidden_size", "state_size", "num_hidden_layers", "layer_norm_epsilon",
        "expand", "conv_kernel", "n_groups", "use_bias", "use_conv_bias", "hidden_act", "residual_in_fp32",
        "time_step_limit", "chunk_size", "tie_word_embeddings", "layer_types",
        "time_step_min",  # dt_bias's initialisation only
    }), "none", "layer_types"),
    "BambaForCausalLM": ArchConfig("bamba", _LLAMA_FAMILY_KEYS | _BAMBA_MIXER_KEYS | {
        "attention_bias", "mlp_bias", "attn_layer_indices", "partial_rotary_factor",
    }, "none", "layer_types"),
    # Granite 4: Bamba's mixers beside Granite's scaled attention (rope or none), a shared
    # MLP on every layer plus routed experts (``num_local_experts`` 0: dense).
    "GraniteMoeHybridForCausalLM": ArchConfig("granitemoehybrid", _LLAMA_FAMILY_KEYS | _BAMBA_MIXER_KEYS | {
        "attention_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
        "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "position_embedding_type",
    }, "none", "layer_types", built_values=(("position_embedding_type", (None, "nope", "rope")),)),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer (``layer_types``
    # "hybrid": a KV cache and a state), Bamba's mixer keys plus its own, and the µP factors.
    "FalconH1ForCausalLM": ArchConfig("falcon_h1", _LLAMA_FAMILY_KEYS | _BAMBA_MIXER_KEYS | {
        "attention_bias", "mlp_bias", "mamba_d_ssm", "mamba_rms_norm", "mamba_norm_before_gate", "projectors_bias",
        "embedding_multiplier", "lm_head_multiplier", "mlp_multipliers", "key_multiplier", "attention_in_multiplier",
        "attention_out_multiplier", "ssm_multipliers", "ssm_in_multiplier", "ssm_out_multiplier",
    }, "none", "layer_types"),
    # Nemotron-H: one mixer per layer by ``layer_types`` (Mamba-2, attention without rope, a
    # relu2 MLP, routed relu2 experts). transformers' code hard-codes attention without bias and
    # mixers of mamba_num_heads x mamba_head_dim channels, clamped at time_step_min
    # (``attention_bias``, ``expand`` and ``time_step_limit`` ignored alike), and builds one shared
    # expert of moe_shared_expert_intermediate_size whatever ``n_shared_experts`` says (ignored
    # alike; ``moe_shared_expert_overlap`` is a scheduling hint); the multi-token-prediction keys
    # are read by layers not run.
    "NemotronHForCausalLM": ArchConfig("nemotron_h", frozenset({
        "vocab_size", "hidden_size", "layers_block_type", "layer_types", "tie_word_embeddings", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "attention_bias", "sliding_window",
        "intermediate_size", "mlp_hidden_act", "mlp_bias", "use_mamba_kernels", "ssm_state_size", "mamba_num_heads",
        "mamba_head_dim", "mamba_hidden_act", "n_groups", "conv_kernel", "expand", "time_step_min", "time_step_limit",
        "use_conv_bias", "chunk_size", "mamba_proj_bias", "mamba_ssm_cache_dtype", "use_bias", "layer_norm_epsilon",
        "residual_in_fp32", "hidden_dropout", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
        "moe_shared_expert_intermediate_size", "moe_latent_size", "moe_shared_expert_overlap", "num_experts_per_tok",
        "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "num_nextn_predict_layers",
        "mtp_layers_block_type",
    }), "none", "layer_types", built_values=(("mlp_hidden_act", ("relu2",)), ("mamba_hidden_act", ("silu",)))),
    # Gated DeltaNet layers (``layer_types`` "linear_attention", on the state cache) beside
    # gated full attention.
    "Qwen3NextForCausalLM": ArchConfig(
        "qwen3_next", _QWEN3_NEXT_KEYS | _QWEN_MOE_KEYS | {"num_experts", "shared_expert_intermediate_size"},
        "none", "layer_types",
    ),
    "Qwen3_5ForCausalLM": ArchConfig("qwen3_5_text", _QWEN3_NEXT_KEYS, "none", "layer_types"),
    "Qwen3_5MoeForCausalLM": ArchConfig(
        "qwen3_5_moe_text", (_QWEN3_NEXT_KEYS - {"intermediate_size"}) | {
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"},
        "none", "layer_types",
    ),
    # Llama 4's text model: chunked local attention with rope and L2 q/k norms on the layers of
    # no_rope_layers 1, full attention without rope (temperature-tuned queries) on the others;
    # a sigmoid top-1 router with a shared expert on the moe_layers, a dense MLP elsewhere.
    "Llama4ForCausalLM": ArchConfig("llama4_text", _LLAMA4_TEXT_KEYS, "chunked"),
    # The language model of a Llama 4 image-text checkpoint, served text-only (``TEXT_ONLY_ARCHITECTURES``).
    "Llama4ForConditionalGeneration": ArchConfig("llama4_text", _LLAMA4_TEXT_KEYS, "chunked"),
    # EAGLE heads: Llama configs (their own keys, ``bias`` ..., are not the class's).
    "EagleLlamaForCausalLM": ArchConfig("llama", _LLAMA_FAMILY_KEYS | {"attention_bias", "mlp_bias"}, "none"),
    "Eagle3LlamaForCausalLM": ArchConfig("llama", _LLAMA_FAMILY_KEYS | {"attention_bias", "mlp_bias"}, "none"),
}

#: Sequence classifiers read the keys of their base model (the head adds none but the labels).
ARCH_CONFIG.update({
    f"{family}ForSequenceClassification": ARCH_CONFIG[base]
    for family, base in (("Bert", "BertModel"), ("Roberta", "RobertaModel"), ("XLMRoberta", "XLMRobertaModel"),
                         ("Qwen3", "Qwen3ForCausalLM"), ("Qwen2", "Qwen2ForCausalLM"), ("Llama", "LlamaForCausalLM"))
})

#: Keys that other architectures' transformers code reads -> whether a value is neutral
#: (the math of the architectures here). Refused when set otherwise, unless honoured.
FOREIGN_KEYS: dict[str, Callable[[Any], bool]] = {
    "attn_logit_softcapping": lambda v: v is None,
    "final_logit_softcapping": lambda v: v is None,
    "query_pre_attn_scalar": lambda v: v is None,
    "logits_scaling": lambda v: v in (None, 1, 1.0),
    "embedding_multiplier": lambda v: v in (None, 1, 1.0),
    "residual_multiplier": lambda v: v in (None, 1, 1.0),
    "attention_multiplier": lambda v: v is None,
    "clip_qkv": lambda v: v is None,
    "partial_rotary_factor": lambda v: v in (None, 1, 1.0),
    "use_qk_norm": lambda v: not v,
    "attention_bias": lambda v: not v,
    "mlp_bias": lambda v: not v,
    "layer_types": lambda v: not v or set(v) == {"full_attention"},
}

_QWEN_VL_KEYS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

#: Image-text architectures served with their vision encoder -> the keys of the whole
#: checkpoint's config that the vision path reads, carried onto the language model's config.
IMAGE_TEXT_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": (
        "vision_config", "image_token_index", "projector_hidden_act", "vision_feature_layer",
        "vision_feature_select_strategy", "multimodal_projector_bias", "image_seq_length",
    ),
    "Qwen2_5_VLForConditionalGeneration": _QWEN_VL_KEYS,
    "Qwen3VLForConditionalGeneration": _QWEN_VL_KEYS,
    "Gemma3ForConditionalGeneration": (
        "vision_config", "image_token_index", "boi_token_index", "eoi_token_index", "mm_tokens_per_image",
    ),
    "Mistral3ForConditionalGeneration": (
        "vision_config", "image_token_index", "projector_hidden_act", "vision_feature_layer",
        "multimodal_projector_bias", "spatial_merge_size",
    ),
}

#: Image-text architectures served by their language model alone (text-only): its config is
#: ``language_model_config``'s, and the vision tower's and projector's tensors are not loaded.
TEXT_ONLY_ARCHITECTURES = frozenset({"Llama4ForConditionalGeneration"})

#: Image-text architectures whose images' tokens attend to each other both ways (transformers'
#: ``token_type_ids`` mask; causal elsewhere): their attention metadata carries each image's
#: range and the scheduler never cuts one (``SchedulerConfig.disable_chunked_mm_input``).
BIDIRECTIONAL_IMAGE_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


def _value(hf_config: Any, key: str) -> Any:
    return getattr(hf_config, key, None)


def _rope_problem(params: dict, check_partial: bool) -> Optional[str]:
    """What of one layer type's rope ``params`` is not built; ``check_partial``: refuse a
    ``partial_rotary_factor`` (the architecture's code rotates every channel)."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        return f"rope type {rope_type!r} is not built (built: {', '.join(ROPE_TYPES)})"
    missing = [key for key in _ROPE_REQUIRED_KEYS.get(rope_type, ()) if key not in params]
    if missing:
        return f"rope type {rope_type!r} lacks {', '.join(missing)}"
    factor = params.get("partial_rotary_factor", 1.0)
    if check_partial and factor not in (None, 1, 1.0):
        return f"partial_rotary_factor {factor} is not built (every channel rotates)"
    return None


def _rope_layer_types(hf_config: Any) -> Optional[list[str]]:
    """The layer types keying transformers 5's per-layer ``rope_parameters`` (Gemma 3:
    "sliding_attention" / "full_attention"); None when one set serves every layer."""
    params = _value(hf_config, "rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        return [key for key, v in params.items() if isinstance(v, dict)]
    return None


def get_rope_parameters(hf_config: Any, layer_type: Optional[str] = None) -> dict:
    """The rope parameters of the layers of ``layer_type`` (None: a model with one set for
    every layer), standardized as transformers 5's ``standardize_rope_params`` does.

    Read from ``rope_parameters`` (transformers 5; flat, or keyed by layer type, e.g. Gemma 3's
    {"sliding_attention": {...}, "full_attention": {...}}) or from 4.x's ``rope_scaling``,
    ``rope_theta`` and ``partial_rotary_factor`` (and Gemma 3's ``rope_local_base_freq``: the
    "default" rope of its "sliding_attention" layers). Returns a new dict with ``rope_type``
    ("default" when unset; 4.x's ``type`` read too), ``rope_theta`` (10000.0 when unset),
    ``partial_rotary_factor`` when the config sets one, ``original_max_position_embeddings``
    for "llama3" / "yarn" / "longrope" (a top-level one first, as Phi-3's; else
    ``max_position_embeddings``), and the type's own keys (``factor``, ``beta_fast`` ...).

    Raises:
        ValueError: per-layer parameters and ``layer_type`` None or not one of their keys.
    """
    layer_types = _rope_layer_types(hf_config)
    if layer_types is not None:
        if layer_type not in layer_types:
            raise ValueError(
                f"rope_parameters are set per layer type ({', '.join(layer_types)}); layer_type={layer_type!r} is none of them."
            )
        params = dict(_value(hf_config, "rope_parameters")[layer_type])
    elif layer_type == "sliding_attention" and _value(hf_config, "rope_local_base_freq") is not None:
        params = {"rope_type": "default", "rope_theta": _value(hf_config, "rope_local_base_freq")}
    else:
        params = dict(_value(hf_config, "rope_parameters") or _value(hf_config, "rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = _value(hf_config, "rope_theta") or 10000.0
    partial = _value(hf_config, "partial_rotary_factor")
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        original = _value(hf_config, "original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", _value(hf_config, "max_position_embeddings"))
    return params


def rope_context_len(max_position_embeddings: int, params: dict) -> int:
    """The context length (tokens) a model of ``max_position_embeddings`` serves with the rope
    ``params`` (``get_rope_parameters``'), by vLLM's rule: x ``factor`` for "linear" and
    "dynamic", ``original_max_position_embeddings`` x ``factor`` for "yarn" (a null factor:
    ``max_position_embeddings``), ``max_position_embeddings`` for the others (their scaling
    is already in it)."""
    rope_type, factor = params.get("rope_type", "default"), params.get("factor")
    if not isinstance(factor, (int, float)):  # none (or a bad one, which check_hf_config names)
        return int(max_position_embeddings)
    if rope_type in ("linear", "dynamic"):
        return int(max_position_embeddings * factor)
    if rope_type == "yarn":
        return int(params.get("original_max_position_embeddings", max_position_embeddings) * factor)
    return int(max_position_embeddings)


def model_context_len(hf_config: Any) -> int:
    """The context length config.json allows: ``max_position_embeddings`` (2048 without it),
    scaled by the rope scaling (``rope_context_len``) unless the rope parameters are set per
    layer type (Gemma 3's ``max_position_embeddings`` is already the scaled length, as vLLM
    reads it)."""
    max_position = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    if _rope_layer_types(hf_config) is not None:
        return max_position
    return rope_context_len(max_position, get_rope_parameters(hf_config))


def _problems(architecture: str, hf_config: Any) -> list[str]:
    arch = ARCH_CONFIG[architecture]
    problems = []
    built = dict(arch.built_values)
    act = _value(hf_config, "hidden_act")
    if "hidden_act" not in built and act not in (None, "silu"):
        problems.append(f"hidden_act={act!r} (built: 'silu')")
    for key, values in built.items():
        if _value(hf_config, key) not in values:
            problems.append(f"{key}={_value(hf_config, key)!r} (built: {', '.join(map(repr, values))})")
    act = _value(hf_config, "hidden_activation")
    if "hidden_activation" in arch.honoured and act not in GELU_ACTIVATIONS:
        problems.append(f"hidden_activation={act!r} (built: {', '.join(map(repr, GELU_ACTIVATIONS))})")
    if _value(hf_config, "use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True (built: causal attention)")
    # A top-level partial_rotary_factor is FOREIGN_KEYS' to report; one inside rope_parameters is here.
    check_partial = "partial_rotary_factor" not in arch.honoured and _value(hf_config, "partial_rotary_factor") is None
    for layer_type in _rope_layer_types(hf_config) or [None]:
        rope = _rope_problem(get_rope_parameters(hf_config, layer_type), check_partial)
        if rope:
            problems.append(f"rope_parameters{f'[{layer_type!r}]' if layer_type else ''}: {rope}")
    window = _value(hf_config, "sliding_window")
    if window == 0 and _value(hf_config, "use_sliding_window") is False:
        window = None  # Qwen2-MoE's config class writes 0 for "no window"
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        problems.append(f"sliding_window={window!r} (a positive number of tokens or null)")
    if arch.windows in ("layer_types", "bidirectional"):
        problems += _layer_type_problems(hf_config)
    if arch.windows == "chunked":
        problems += _chunked_layer_type_problems(hf_config)
    if arch.windows == "none" and window is not None and _value(hf_config, "use_sliding_window") is not False:
        problems.append(
            f"sliding_window={window} ({architecture} attends over the whole context, as transformers' code does; "
            "set use_sliding_window false or sliding_window null)"
        )
    for key, neutral in FOREIGN_KEYS.items():
        if key in arch.honoured or key == "sliding_window":
            continue
        value = _value(hf_config, key)
        if not neutral(value):
            problems.append(f"{key}={value!r} ({architecture}'s code does not read it)")
    return problems


def _layer_type_problems(hf_config: Any) -> list[str]:
    kinds = _value(hf_config, "layer_types")
    if kinds is None:
        return []
    problems = []
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types {unknown} (built: {', '.join(LAYER_TYPES)})")
    if len(kinds) != hf_config.num_hidden_layers:
        problems.append(f"layer_types has {len(kinds)} entries for {hf_config.num_hidden_layers} layers")
    if "sliding_attention" in kinds and _value(hf_config, "sliding_window") is None:
        problems.append("layer_types has sliding_attention layers but sliding_window is null")
    return problems


def _chunked_layer_type_problems(hf_config: Any) -> list[str]:
    kinds = _value(hf_config, "layer_types") or []
    problems = []
    unknown = sorted(set(kinds) - set(CHUNKED_LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types {unknown} (built: {', '.join(CHUNKED_LAYER_TYPES)})")
    if kinds and len(kinds) != hf_config.num_hidden_layers:
        problems.append(f"layer_types has {len(kinds)} entries for {hf_config.num_hidden_layers} layers")
    chunk = _value(hf_config, "attention_chunk_size")
    if "chunked_attention" in kinds and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        problems.append(f"attention_chunk_size={chunk!r} for chunked_attention layers (a positive number of tokens)")
    return problems


def check_hf_config(hf_config: Any) -> None:
    """Refuse a config whose architecture's code would ignore or misread one of its keys.

    Args:
        hf_config: a transformers ``PretrainedConfig`` (``architectures[0]`` names the class).

    Raises:
        ValueError: naming each offending key and value; an architecture not in
            ``ARCH_CONFIG`` is left to the model registry's error.
    """
    architecture = (_value(hf_config, "architectures") or ["<none>"])[0]
    if architecture not in ARCH_CONFIG:
        return
    problems = _problems(architecture, hf_config)
    if problems:
        raise ValueError(
            f"config.json of this {architecture} model sets what pagedllm does not build: {'; '.join(problems)}."
        )


def language_model_config(hf_config: Any) -> Any:
    """The config the model code reads: ``hf_config`` itself, or for an architecture of
    ``IMAGE_TEXT_ARCHITECTURES`` or ``TEXT_ONLY_ARCHITECTURES`` its ``text_config``, given the
    whole checkpoint's ``architectures``, ``tie_word_embeddings`` (transformers ties by the
    outer config), ``dtype``, ``quantization_config`` and the vision keys of
    ``IMAGE_TEXT_ARCHITECTURES`` (none for a text-only one). Edits that sub-config in place."""
    architecture = (_value(hf_config, "architectures") or ["<none>"])[0]
    if architecture not in IMAGE_TEXT_ARCHITECTURES and architecture not in TEXT_ONLY_ARCHITECTURES:
        return hf_config
    text = hf_config.text_config
    text.architectures = [architecture]
    text.tie_word_embeddings = bool(_value(hf_config, "tie_word_embeddings"))
    for key in ("dtype", "quantization_config"):
        if _value(hf_config, key) is not None:
            setattr(text, key, _value(hf_config, key))
    for key in IMAGE_TEXT_ARCHITECTURES.get(architecture, ()):
        setattr(text, key, _value(hf_config, key))
    return text


def layer_sliding_windows(hf_config: Any) -> list[Optional[int]]:
    """Each layer's attention window in tokens (None: the whole context), as transformers'
    modeling code of ``architectures[0]`` applies ``sliding_window`` (see ``ArchConfig.windows``);
    all None for an architecture not in ``ARCH_CONFIG``."""
    num_layers = hf_config.num_hidden_layers
    arch = ARCH_CONFIG.get((_value(hf_config, "architectures") or ["<none>"])[0])
    window = _value(hf_config, "sliding_window")
    if arch is None or arch.windows in ("none", "bidirectional", "chunked") or window is None:
        return [None] * num_layers
    if arch.windows == "all":
        return [window] * num_layers
    kinds = _value(hf_config, "layer_types") or ["full_attention"] * num_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def layer_attention_chunk_sizes(hf_config: Any) -> list[Optional[int]]:
    """Each layer's chunked local attention size in tokens (None: not chunked): an
    architecture of ``ArchConfig.windows`` "chunked" gives ``attention_chunk_size`` to its
    "chunked_attention" ``layer_types`` (transformers' Llama 4: a query at position i sees keys
    i - i % C .. i); all None for any other."""
    num_layers = hf_config.num_hidden_layers
    arch = ARCH_CONFIG.get((_value(hf_config, "architectures") or ["<none>"])[0])
    chunk = _value(hf_config, "attention_chunk_size")
    if arch is None or arch.windows != "chunked" or chunk is None:
        return [None] * num_layers
    kinds = _value(hf_config, "layer_types") or ["full_attention"] * num_layers
    return [chunk if kind == "chunked_attention" else None for kind in kinds]


def state_layer_indices(hf_config: Any) -> list[int]:
    """The layers of ``hf_config`` that keep a recurrent state, alone or beside attention (see
    ``ArchConfig.state_layers``); none for an architecture not in ``ARCH_CONFIG``."""
    return _state_layers_of_kinds(hf_config, (STATE_LAYER_TYPE, HYBRID_LAYER_TYPE))


def hybrid_layer_indices(hf_config: Any) -> list[int]:
    """The layers of ``hf_config`` that keep a recurrent state and a KV cache side by side
    (``HYBRID_LAYER_TYPE``, Falcon-H1's every layer); none for most architectures."""
    return _state_layers_of_kinds(hf_config, (HYBRID_LAYER_TYPE,))


def _state_layers_of_kinds(hf_config: Any, kinds: tuple[str, ...]) -> list[int]:
    arch = ARCH_CONFIG.get((_value(hf_config, "architectures") or ["<none>"])[0])
    if arch is None or arch.state_layers == "none":
        return []
    layer_types = _value(hf_config, "layer_types") or []
    return [i for i, kind in enumerate(layer_types) if kind in kinds]


def cacheless_layer_indices(hf_config: Any) -> list[int]:
    """The layers of ``hf_config`` that keep neither KV nor a state (``layer_types`` entries of
    ``CACHELESS_LAYER_TYPES``); none for an architecture not in ``ARCH_CONFIG``."""
    if (_value(hf_config, "architectures") or ["<none>"])[0] not in ARCH_CONFIG:
        return []
    kinds = _value(hf_config, "layer_types") or []
    return [i for i, kind in enumerate(kinds) if kind in CACHELESS_LAYER_TYPES]


def min_sliding_window(hf_config: Any) -> Optional[int]:
    """The smallest window of any layer (vLLM's ``get_sliding_window``); None: no layer has one."""
    windows = [w for w in layer_sliding_windows(hf_config) if w is not None]
    return min(windows) if windows else None


def disable_sliding_window(hf_config: Any) -> None:
    """Make every layer of ``hf_config`` attend over the whole context (vLLM's
    ``--disable-sliding-window``): ``sliding_window`` None, ``layer_types`` all
    "full_attention". Edits ``hf_config`` in place."""
    hf_config.sliding_window = None
    if _value(hf_config, "layer_types") is not None:
        hf_config.layer_types = ["full_attention"] * len(hf_config.layer_types)
