"""NVIDIA Nemotron-H (``NemotronHForCausalLM``): a stack of pre-norm residual blocks, each an
RMSNorm and one mixer chosen by ``layer_types`` (config.json's ``hybrid_override_pattern``:
"M" a Mamba-2 mixer on the state cache, "*" attention without position embedding on the paged
KV cache, "-" an MLP ``down(relu(up(x)) ** 2)`` that keeps no cache), then ``norm_f`` and the LM
head, as transformers' ``modeling_nemotron_h`` (our own code on the shared layers). Routed-expert
layers ("E") are refused. The mixers clamp dt' from below at ``time_step_min`` (transformers'
chunked scan; its one-token step does not clamp, which differs only where dt' < ``time_step_min``)."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2, mamba2_state_shape
from pagedllm.model_executor.layers.quantization import QuantizationConfig
from pagedllm.model_executor.models.granitemoehybrid import NoPositionEmbedding
from pagedllm.model_executor.models.llama import LlamaAttention
from pagedllm.model_executor.models.mamba2 import Mamba2ForCausalLM


class NemotronHMLP(nn.Module):
    """x [T, H] -> down(relu(up(x)) ** 2) [T, H] (``mlp_hidden_act`` "relu2"; ``mlp_bias``)."""

    def __init__(self, config: PretrainedConfig, quant_config: Optional[QuantizationConfig], prefix: str) -> None:
        super().__init__()
        bias = bool(config.mlp_bias)
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=bias,
                                            quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        del rope
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


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
        ValueError: a layer type not built (routed experts, "moe").
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
        else:
            raise ValueError(f"Nemotron-H layer {layer_idx} is {kind!r}: pagedllm builds 'M' (Mamba-2), '*' "
                             "(attention) and '-' (MLP) layers, not routed experts.")

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
    def get_mamba_state_shape_from_config(cls, config: PretrainedConfig) -> tuple[tuple[int, ...], ...]:
        """A mixer layer's (conv, ssm) state shapes per slot (``mamba2_state_shape``)."""
        return mamba2_state_shape(config.mamba_num_heads * config.mamba_head_dim, config.n_groups,
                                  config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                                  config.conv_kernel)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """(conv, ssm) state dtypes: the model's ``dtype``, the ssm state float32 with
        ``mamba_ssm_cache_dtype`` "float32"."""
        ssm = torch.float32 if getattr(config, "mamba_ssm_cache_dtype", None) == "float32" else dtype
        return dtype, ssm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``Mamba2ForCausalLM.load_weights``, an MLP's ``up_proj`` loaded as it is (not as part
        of a gate/up pair); returns the names loaded.

        Raises:
            ValueError: for a checkpoint tensor with no matching parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def others():
            for name, tensor in weights:
                if ".mixer.up_proj." in name and name in params:
                    params[name].weight_loader(params[name], tensor)
                    loaded.add(name)
                else:
                    yield name, tensor

        return super().load_weights(others()) | loaded
