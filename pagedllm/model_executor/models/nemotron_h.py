"""NVIDIA Nemotron-H (``NemotronHForCausalLM``): a stack of pre-norm residual blocks, each an
RMSNorm and one mixer chosen by ``layer_types`` (config.json's ``hybrid_override_pattern``:
"M" a Mamba-2 mixer on the state cache, "*" attention without position embedding on the paged
KV cache, "-" an MLP ``down(relu(up(x)) ** 2)`` and "E" routed experts of that MLP plus shared
experts, which keep no cache), then ``norm_f`` and the LM head, as transformers'
``modeling_nemotron_h`` (our own code on the shared layers). The mixers clamp dt' from below at
``time_step_min`` (transformers' chunked scan; its one-token step does not clamp, which differs
only where dt' < ``time_step_min``).

An "E" layer (``NemotronHMoE``) routes as DeepSeek-V3 does (``FusedMoE``'s grouped top-k): a
float32 sigmoid router plus ``e_score_correction_bias`` for the choice, ``n_group`` groups of
which ``topk_group`` are kept, ``num_experts_per_tok`` experts, their unbiased scores
renormalised with ``norm_topk_prob`` and times ``routed_scaling_factor``; the experts are ungated
relu2 MLPs of ``moe_intermediate_size`` (in ``moe_latent_size`` dimensions between two
projections when it is set), the shared experts one relu2 MLP of
``moe_shared_expert_intermediate_size``."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.activation import ReLUSquaredActivation
from pagedllm.model_executor.layers.fused_moe import FusedMoE
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, mamba2_state_shape
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.granitemoehybrid import NoPositionEmbedding
from pagedllm.model_executor.models.llama import LlamaAttention
from pagedllm.model_executor.models.llama_moe import LlamaMoEForCausalLM
from pagedllm.model_executor.models.mamba2 import Mamba2ForCausalLM
from pagedllm.model_executor.models.pipeline_stage import other_stage_prefixes


class NemotronHMLP(nn.Module):
    """x [T, H] -> down(relu(up(x)) ** 2) [T, H] (``mlp_hidden_act`` "relu2"; ``mlp_bias``) of
    ``intermediate_size`` (None: the config's; the shared experts pass theirs)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str,
                 intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        bias, intermediate_size = bool(config.mlp_bias), intermediate_size or config.intermediate_size
        self.up_proj = ColumnParallelLinear(config.hidden_size, intermediate_size, bias=bias,
                                            quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = ReLUSquaredActivation()

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        del rope
        return self.down_proj(self.act_fn(self.up_proj(x)))


class NemotronHTopkRouter(nn.Module):
    """x [T, H] -> router logits [T, E] float32: ``weight`` [E, H] kept in float32, as
    transformers' router computes (its ``e_score_correction_bias`` [E] float32 is read by the
    experts' grouped top-k)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(num_experts, config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class NemotronHMoE(nn.Module):
    """An "E" layer's mixer (see the module): x [T, H] -> routed experts (``FusedMoE``,
    "relu2_no_mul") plus ``shared_experts(x)``; with ``moe_latent_size`` L the experts run on
    ``fc1_latent_proj(x)`` [T, L] and their sum goes back through ``fc2_latent_proj``."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        latent = config.moe_latent_size
        self.gate = NemotronHTopkRouter(config)
        self.experts = FusedMoE(
            config.n_routed_experts, config.num_experts_per_tok, latent or config.hidden_size,
            config.moe_intermediate_size, reduce_results=True, renormalize=bool(config.norm_topk_prob),
            use_grouped_topk=True, num_expert_group=config.n_group, topk_group=config.topk_group,
            quant_config=quant_config, prefix=f"{prefix}.experts", scoring_func="sigmoid",
            routed_scaling_factor=float(config.routed_scaling_factor),
            e_score_correction_bias=self.gate.e_score_correction_bias, activation="relu2_no_mul",
        )
        self.shared_experts = NemotronHMLP(config, quant_config, f"{prefix}.shared_experts",
                                           config.moe_shared_expert_intermediate_size)
        self.fc1_latent_proj: Optional[ReplicatedLinear] = None
        if latent is not None:
            bias = bool(config.mlp_bias)
            self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, latent, bias=bias, quant_config=quant_config,
                                                    prefix=f"{prefix}.fc1_latent_proj")
            self.fc2_latent_proj = ReplicatedLinear(latent, config.hidden_size, bias=bias, quant_config=quant_config,
                                                    prefix=f"{prefix}.fc2_latent_proj")

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        if self.fc1_latent_proj is None:
            routed = self.experts(x, router_logits)
        else:
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), router_logits))
        return routed.add_(self.shared_experts(rope, x))


class NemotronHMixer(MambaMixer2):
    """``MambaMixer2`` of Nemotron-H's config keys (``mamba_num_heads`` x ``mamba_head_dim``
    channels), called as the other mixers are (``forward(rope, hidden_states)``)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__(
            config.hidden_size, config.mamba_num_heads * config.mamba_head_dim, config.mamba_num_heads,
            config.mamba_head_dim, config.n_groups, config.ssm_state_size, config.conv_kernel, config.chunk_size,
            config.use_conv_bias, config.use_bias, config.layer_norm_epsilon, (config.time_step_min, math.inf),
            quant_config, prefix,
        )

    def forward(self, rope, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        del rope
        return super().forward(hidden_states)


class NemotronHBlock(nn.Module):
    """h = h + mixer(norm(h)), the stream travelling as (hidden_states, residual) as
    ``Mamba2DecoderLayer``'s; ``mixer`` by the layer's ``layer_types`` entry.

    Raises:
        ValueError: a layer type not built.
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                 prefix: str) -> None:
        super().__init__()
        kind = config.layer_types[layer_idx]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer: nn.Module = NemotronHMixer(config, quant_config, f"{prefix}.mixer")
        elif kind == "full_attention":
            self.mixer = LlamaAttention(config, False, False, NoPositionEmbedding(), quant_config, f"{prefix}.mixer",
                                        o_bias=False)
        elif kind == "mlp":
            self.mixer = NemotronHMLP(config, quant_config, f"{prefix}.mixer")
        elif kind == "moe":
            self.mixer = NemotronHMoE(config, quant_config, f"{prefix}.mixer")
        else:
            raise ValueError(f"Nemotron-H layer {layer_idx} is {kind!r}: pagedllm builds 'M' (Mamba-2), '*' "
                             "(attention), '-' (MLP) and 'E' (routed experts) layers.")

    def forward(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]):
        if residual is None:
            residual, hidden_states = hidden_states, self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        return self.mixer((), hidden_states), residual  # no rope: nothing for the attention's table


class NemotronHForCausalLM(Mamba2ForCausalLM):
    """``Mamba2ForCausalLM``'s interface and checkpoint names (``backbone.embeddings``,
    ``backbone.layers.i.{norm, mixer}``, ``backbone.norm_f``, ``lm_head``) with a
    ``NemotronHBlock`` per layer. ``get_mamba_state_shape_from_config`` /
    ``get_mamba_state_dtype_from_config`` (vLLM's names): a mixer layer's state, the ssm state in
    float32 when ``mamba_ssm_cache_dtype`` says so (as vLLM reads it)."""

    def make_layer(self, config: PretrainedConfig, layer_idx: int, quant_config: Optional[QuantizationConfig],
                   prefix: str) -> nn.Module:
        return NemotronHBlock(config, layer_idx, quant_config, prefix)

    @classmethod
    def get_mamba_state_shape_from_config(cls, config: PretrainedConfig,
                                          tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """A mixer layer's (conv, ssm) state shapes per slot on each of ``tp_size`` ranks
        (``mamba2_state_shape``)."""
        return mamba2_state_shape(config.mamba_num_heads * config.mamba_head_dim, config.n_groups,
                                  config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                                  config.conv_kernel, tp_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """(conv, ssm) state dtypes: the model's ``dtype``, the ssm state float32 with
        ``mamba_ssm_cache_dtype`` "float32"."""
        ssm = torch.float32 if getattr(config, "mamba_ssm_cache_dtype", None) == "float32" else dtype
        return dtype, ssm

    #: The routed experts' checkpoint matrices -> ``FusedMoE`` shard ids (ungated: up is W13's
    #: only matrix), read by ``LlamaMoEForCausalLM``'s expert loading, which this class borrows.
    expert_projections = {"up_proj": "w1", "down_proj": "w2"}
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    _route_experts = LlamaMoEForCausalLM._route_experts
    _load_expert = LlamaMoEForCausalLM._load_expert

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``Mamba2ForCausalLM.load_weights``, an MLP's (or the shared experts') ``up_proj``
        loaded as it is (not as part of a gate/up pair), the routed experts' matrices (per
        expert, ``experts.<id>.up_proj.weight``, or stacked, ``experts.up_proj``) into their
        ``FusedMoE``; returns the names loaded.

        Raises:
            ValueError: for a checkpoint tensor with no matching parameter, a shape mismatch, or
                an expert layer left without some expert's matrix.
        """
        params = dict(self.named_parameters())
        moe_layers = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        loaded: set[str] = set()

        def others():
            for name, tensor in self._route_experts(weights, moe_layers, other_stage_prefixes(self), loaded):
                if ".up_proj." in name and name in params:
                    params[name].weight_loader(params[name], tensor)
                    loaded.add(name)
                else:
                    yield name, tensor

        loaded |= super().load_weights(others())
        for name, layer in moe_layers.items():
            if layer.missing_weights():
                raise ValueError(f"The checkpoint lacks expert weights of {name}: "
                                 f"{', '.join(layer.missing_weights()[:8])}.")
        return loaded
