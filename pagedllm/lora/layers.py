"""``LoRALinearMethod``: a linear layer's ``quant_method`` wrapped so that each token adds
its adapter's low-rank update, the whole mixed batch at once.

For a layer whose output is fused slices (``[q | k | v]``, ``[gate | up]``, or one slice),
slot s of the ``max_loras`` device slots holds, per slice j, ``A_j`` [r_j, in] and
``scaling * B_j`` [out_j, r_j], padded with zeros to ``max_lora_rank`` R::

    lora_a     [max_loras, n_slices * R, in]      rows j*R .. j*R + r_j: A_j
    lora_b[j]  [max_loras, out_j, R]              columns 0 .. r_j: scaling * B_j

Each step, ``LoRAStepMapping.groups`` lists the active slots with the tokens that use them.
Per slot: shrink ``xa = x[tokens] @ lora_a[s]^T`` (all slices in one matmul), expand
``delta[:, slice j] = xa[:, j*R:(j+1)*R] @ lora_b[j][s]^T``, then ``y[tokens] += delta``. That is Punica's SGMV
(Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") in plain PyTorch: tokens grouped by
adapter, one matmul per active slot, never one per request; tokens with no adapter cost
nothing. The base product is the wrapped method's own (unquantized, int8 ...), so LoRA
works over any base (vLLM's ``BaseLinearLayerWithLoRA`` does the same over ``quant_method``).

One device today (tensor-parallel size 1): A and B are whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.layers.linear import LinearMethodBase
from pagedllm.model_executor.layers.quantization import QuantizeMethodBase


@dataclass
class LoRAStepMapping:
    """This step's tokens as runs of one adapter slot, set once per step by the
    ``LoRAModelManager`` and read by every ``LoRALinearMethod``.

    ``groups``: (slot, start, end) for each run of consecutive tokens ``start .. end - 1``
    that use ``slot``; tokens of no run use no adapter. The model runner orders a step's
    requests by slot (decodes, then prefills), so each slot has at most two runs.
    """

    groups: list[tuple[int, int, int]] = field(default_factory=list)

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        """Find the runs of ``token_slots`` ([T] int64 slot per token, -1 = no adapter)."""
        if len(token_slots) == 0:
            self.groups = []
            return
        change = np.flatnonzero(np.diff(token_slots)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [len(token_slots)]))
        self.groups = [(int(token_slots[s]), int(s), int(e)) for s, e in zip(starts, ends) if token_slots[s] >= 0]


class LoRALinearMethod(LinearMethodBase):
    """Wraps ``base`` (the layer's method): ``apply`` is the base product plus each token's
    adapter update (see the module docstring).

    Args:
        base: the layer's method, already applied to loaded weights.
        layer: the linear layer (``input_size_per_partition``, ``output_partition_sizes``).
        max_loras, max_lora_rank: slots and the padded rank R.
        mapping: the step's token groups, shared by every wrapped layer.
        dtype, device: of the A/B tensors (the model's).
    """

    def __init__(
        self, base: QuantizeMethodBase, layer: nn.Module, max_loras: int, max_lora_rank: int,
        mapping: LoRAStepMapping, dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.base = base
        self.mapping = mapping
        self.max_lora_rank = max_lora_rank
        self.output_sizes: list[int] = list(layer.output_partition_sizes)
        self.offsets = [sum(self.output_sizes[:j]) for j in range(len(self.output_sizes))]
        in_features = layer.input_size_per_partition
        self.lora_a = torch.zeros(max_loras, len(self.output_sizes) * max_lora_rank, in_features, dtype=dtype, device=device)
        self.lora_b = [torch.zeros(max_loras, n, max_lora_rank, dtype=dtype, device=device) for n in self.output_sizes]

    @property
    def nbytes(self) -> int:
        """Bytes of the A/B slot tensors."""
        return sum(t.numel() * t.element_size() for t in (self.lora_a, *self.lora_b))

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.base.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    def describe_path(self, layer: nn.Module) -> str:
        return f"{self.base.describe_path(layer)} + LoRA"

    def set_slot(self, slot: int, slices: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Write one adapter into ``slot``: per output slice, (A [r, in], scaling * B [out_j, r])
        or None (that slice has no update). Clears what the slot held.

        Raises:
            ValueError: a rank above ``max_lora_rank`` or a shape that does not fit.
        """
        self.lora_a[slot].zero_()
        for j, lora in enumerate(slices):
            self.lora_b[j][slot].zero_()
            if lora is None:
                continue
            a, b = lora
            r = a.shape[0]
            if r > self.max_lora_rank or a.shape[1] != self.lora_a.shape[2] or tuple(b.shape) != (self.output_sizes[j], r):
                raise ValueError(
                    f"LoRA slice {j}: A {list(a.shape)} / B {list(b.shape)} do not fit this layer "
                    f"(in {self.lora_a.shape[2]}, out {self.output_sizes[j]}, rank <= {self.max_lora_rank})."
                )
            start = j * self.max_lora_rank
            self.lora_a[slot, start : start + r].copy_(a)
            self.lora_b[j][slot, :, :r].copy_(b)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] (the step's tokens, in the mapping's order) -> [T, out], x's dtype."""
        y = self.base.apply(layer, x, bias)
        for slot, start, end in self.mapping.groups:
            y[start:end] += self._expand(x[start:end] @ self.lora_a[slot].T, slot)
        return y

    def _expand(self, xa: torch.Tensor, slot: int) -> torch.Tensor:
        """xa [t, n_slices * R] -> [t, out]: each slice's rank-R part times its B."""
        rank = self.max_lora_rank
        parts = [xa[:, j * rank : (j + 1) * rank] @ b[slot].T for j, b in enumerate(self.lora_b)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
