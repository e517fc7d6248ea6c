"""What one pipeline stage holds of a decoder stack, and what passes between stages (the
seam every decoder stack uses: ``LlamaModel``, ``Mamba2ForCausalLM``).

A stage holds decoder layers ``[start_layer, end_layer)`` (``pp_layer_range``) and a
``PPMissingLayer`` in place of every other module; the first stage embeds the tokens, a later
one takes the previous stage's ``IntermediateTensors`` instead, ``{"hidden_states",
"residual"}`` [T, hidden] each (the residual stream as the layers carry it: a block's output
not yet added, and the sum so far); the last stage applies the final norm, the others return
that dict for the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.distributed import get_pp_group
from pagedllm.distributed.utils import pp_layer_range

#: ``IntermediateTensors``: the tensors one stage sends the next, by name.
IntermediateTensors = dict[str, torch.Tensor]


class PPMissingLayer(nn.Identity):
    """Stands for a module held by another pipeline stage: no parameters, not loaded."""


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage of a ``num_layers``-layer stack (``of``)."""

    start_layer: int
    end_layer: int
    is_first: bool
    is_last: bool

    @classmethod
    def of(cls, num_layers: int) -> "PipelineStage":
        """This rank's stage (the whole stack without pipeline parallelism).

        Raises:
            ValueError: as ``pp_layer_range`` (more stages than layers, a bad partition).
        """
        pp = get_pp_group()
        start, end = pp_layer_range(num_layers, pp.rank_in_group, pp.world_size)
        return cls(start, end, pp.is_first_rank, pp.is_last_rank)

    def make_layers(self, num_layers: int, make_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
        """``make_layer(i)`` for this stage's layers, a ``PPMissingLayer`` for the others (so
        checkpoint names keep their layer index)."""
        return nn.ModuleList(make_layer(i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
                             for i in range(num_layers))

    @staticmethod
    def held(is_held: bool, make: Callable[[], nn.Module]) -> nn.Module:
        """``make()`` where this stage holds the module, else a ``PPMissingLayer``."""
        return make() if is_held else PPMissingLayer()

    def inputs(self, intermediate_tensors: Optional[IntermediateTensors],
               embed: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The first layer's ``(hidden_states, residual)``: ``(embed(), None)`` on the first
        stage, the previous stage's tensors on the others.

        Raises:
            ValueError: a later stage called without ``intermediate_tensors``.
        """
        if self.is_first:
            return embed(), None
        if intermediate_tensors is None:
            raise ValueError("A pipeline stage after the first needs the previous stage's intermediate_tensors.")
        return intermediate_tensors["hidden_states"], intermediate_tensors["residual"]

    def outputs(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                norm: nn.Module) -> torch.Tensor | IntermediateTensors:
        """After this stage's layers: ``norm(hidden_states + residual)`` [T, hidden] on the last
        stage (``norm`` fuses the add: ``norm(x, residual) -> (out, sum)``), the
        ``IntermediateTensors`` for the next stage on the others."""
        if not self.is_last:
            return {"hidden_states": hidden_states, "residual": residual}
        if residual is None:
            return norm(hidden_states)
        return norm(hidden_states, residual)[0]


def without_other_stages(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` less the checkpoint tensors of modules another stage holds (those that are
    a ``PPMissingLayer`` in ``model``)."""
    other_stages = other_stage_prefixes(model)
    return ((name, tensor) for name, tensor in weights if not name.startswith(other_stages))


def other_stage_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes (``"model.layers.3."``) of ``model``'s ``PPMissingLayer`` modules."""
    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))
