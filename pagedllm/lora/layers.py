"""``LoRALinearMethod``: a linear layer's ``quant_method`` wrapped so that each token adds
its adapter's low-rank update, the whole mixed batch at once.

For a layer whose output is fused slices (``[q | k | v]``, ``[gate | up]``, or one slice),
slot s of the ``max_loras`` device slots holds, per slice j, ``A_j`` [r_j, in] and
``scaling * B_j`` [out_j, r_j], transposed and padded with zeros to ``max_lora_rank`` R::

    lora_a     [max_loras, in, n_slices * R]      columns j*R .. j*R + r_j: A_j^T
    lora_b     [max_loras, R, out]                rows 0 .. r_j of slice j's columns:
                                                  (scaling * B_j)^T

Each step, ``LoRAStepMapping.groups`` lists runs of consecutive tokens of one slot (the
runner orders requests by slot, so a slot has at most two runs: among the decodes and
among the prefills). Per run: shrink ``xa = x[run] @ lora_a[s]`` (all slices in one
matmul), then expand ``y[run, slice j] += xa[:, j*R:(j+1)*R] @ lora_b[s][:, slice j]``. That is
Punica's SGMV (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") in plain PyTorch:
tokens grouped by adapter into segments, one shrink per segment, never one per request,
and no gather or scatter; tokens with no adapter cost nothing. On CPU the C++ kernel
``lora_sgmv`` does all runs and slices of a layer in one call, with the same arithmetic
(one decoder layer of the 0.5B shape, 8 rank-16 adapters x 8 decode tokens, one thread, on
a loaded machine: LoRA added 4.3 ms with a matmul per run and slice, 2.1 ms with the kernel). The base product is the
wrapped method's own (unquantized, int8, int4 ...), so LoRA works over any base (vLLM's
``BaseLinearLayerWithLoRA`` does the same over ``quant_method``).

A and B are stored in the model's dtype (vLLM's ``--lora-dtype auto``: bfloat16 for a
bfloat16 model, float32 for a float32 one): at decode the delta's time is reading them (8
rank-16 adapters on all 7 projections of the 0.5B shape: 280 MB per step in float32, 140 MB
in bfloat16). Both paths widen them to float32 and compute the update in float32, cast to
y's dtype before it is added, so a float32 model's arithmetic is unchanged.

Tensor parallelism (vLLM's ``ColumnParallelLinearWithLoRA`` / ``RowParallelLinearWithLoRA``
split): each rank keeps the part of A and B that matches its part of the base weight, as the
layer reports it (``LinearBase.input_part`` / ``output_part``). Column-parallel (qkv, gate_up):
A whole, B's rows (slice j's output features) cut as the weight's, so the rank computes its
own output columns of the update (KV heads replicated over ranks: B's rows of the rank's
head). Row-parallel (o, down): A's input columns cut as the weight's, B whole: the rank's
``x_i A_i^T B^T`` is its partial sum of ``x A^T B^T``, added to its partial base output
before the layer's all-reduce sums both, so no extra collective is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.linear import LinearMethodBase
from pagedllm.model_executor.layers.quantization import QuantizeMethodBase
from pagedllm.platforms import current_platform


@dataclass
class LoRAStepMapping:
    """This step's tokens as runs of one adapter slot, set once per step by the
    ``LoRAModelManager`` and read by every ``LoRALinearMethod``.

    ``groups``: (slot, start, end) for each run of consecutive tokens ``start .. end - 1``
    that use ``slot``; tokens of no run use no adapter. The model runner orders a step's
    requests by slot (decodes, then prefills), so each slot has at most two runs.
    ``groups_tensor``: the same as a [G, 3] int64 CPU tensor (the CPU kernel's argument).
    """

    groups: list[tuple[int, int, int]] = field(default_factory=list)
    groups_tensor: torch.Tensor = field(default_factory=lambda: torch.empty(0, 3, dtype=torch.int64))

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        """Find the runs of ``token_slots`` ([T] int64 slot per token, -1 = no adapter)."""
        if len(token_slots) == 0:
            self.groups = []
            self.groups_tensor = torch.empty(0, 3, dtype=torch.int64)
            return
        change = np.flatnonzero(np.diff(token_slots)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [len(token_slots)]))
        self.groups = [(int(token_slots[s]), int(s), int(e)) for s, e in zip(starts, ends) if token_slots[s] >= 0]
        self.groups_tensor = torch.tensor(self.groups, dtype=torch.int64).reshape(-1, 3)


class LoRALinearMethod(LinearMethodBase):
    """Wraps ``base`` (the layer's method): ``apply`` is the base product plus each token's
    adapter update (see the module docstring).

    Args:
        base: the layer's method, already applied to loaded weights.
        layer: the linear layer (``input_size_per_partition``, ``output_partition_sizes``,
            this rank's ``input_part`` / ``output_part`` of the whole matrix).
        max_loras, max_lora_rank: slots and the padded rank R.
        mapping: the step's token groups, shared by every wrapped layer.
        device, dtype: of the A/B tensors (the model's; see the module docstring).
    """

    def __init__(
        self, base: QuantizeMethodBase, layer: nn.Module, max_loras: int, max_lora_rank: int,
        mapping: LoRAStepMapping, device: torch.device, dtype: torch.dtype,
    ) -> None:
        self.base = base
        self.mapping = mapping
        self.max_lora_rank = max_lora_rank
        self.output_sizes: list[int] = list(layer.output_partition_sizes)
        self.offsets = [sum(self.output_sizes[:j]) for j in range(len(self.output_sizes))]
        in_features = layer.input_size_per_partition
        self.input_part = layer.input_part()
        self.output_parts = [layer.output_part(j) for j in range(len(self.output_sizes))]
        self.lora_a = torch.zeros(max_loras, in_features, len(self.output_sizes) * max_lora_rank, device=device,
                                  dtype=dtype)
        self.lora_b = torch.zeros(max_loras, max_lora_rank, sum(self.output_sizes), device=device, dtype=dtype)
        self.use_kernel = current_platform.is_cpu and cpu_kernels.is_available()

    @property
    def nbytes(self) -> int:
        """Bytes of the A/B slot tensors."""
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b))

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.base.create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    def describe_path(self, layer: nn.Module) -> str:
        return f"{self.base.describe_path(layer)} + LoRA"

    def set_slot(self, slot: int, slices: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Write one adapter into ``slot``: per output slice, (A [r, in], scaling * B [out_j, r])
        of the whole matrix (all ranks), or None (that slice has no update), rounded to the
        slots' dtype; this rank keeps its part (see the module docstring). Clears what the slot held.

        Raises:
            ValueError: a rank above ``max_lora_rank`` or a shape that does not fit.
        """
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        in_part, in_parts = self.input_part
        in_features = self.lora_a.shape[1]
        for j, lora in enumerate(slices):
            if lora is None:
                continue
            a, b = lora
            r = a.shape[0]
            out_part, out_parts = self.output_parts[j]
            out_features = self.output_sizes[j]
            if (r > self.max_lora_rank or a.shape[1] != in_features * in_parts
                    or tuple(b.shape) != (out_features * out_parts, r)):
                raise ValueError(
                    f"LoRA slice {j}: A {list(a.shape)} / B {list(b.shape)} do not fit this layer "
                    f"(in {in_features * in_parts}, out {out_features * out_parts}, rank <= {self.max_lora_rank})."
                )
            a = a.narrow(1, in_part * in_features, in_features)
            b = b.narrow(0, out_part * out_features, out_features)
            start = j * self.max_lora_rank
            self.lora_a[slot, :, start : start + r].copy_(a.T)
            offset = self.offsets[j]
            self.lora_b[slot, :r, offset : offset + self.output_sizes[j]].copy_(b.T)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] (the step's tokens, in the mapping's order) -> [T, out], x's dtype."""
        y = self.base.apply(layer, x, bias)
        if not self.mapping.groups:
            return y
        if self.use_kernel and y.is_contiguous():
            cpu_kernels.lora_sgmv(y, x.contiguous(), self.lora_a, self.lora_b, self.mapping.groups_tensor,
                                  self.output_sizes)
            return y
        rank = self.max_lora_rank
        for slot, start, end in self.mapping.groups:
            xa = x[start:end].float() @ self.lora_a[slot].float()
            for j, (offset, size) in enumerate(zip(self.offsets, self.output_sizes)):
                delta = xa[:, j * rank : (j + 1) * rank] @ self.lora_b[slot, :, offset : offset + size].float()
                y[start:end, offset : offset + size] += delta.to(y.dtype)
        return y
