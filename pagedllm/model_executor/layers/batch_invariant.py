"""``--batch-invariant`` (vLLM's ``VLLM_BATCH_INVARIANT``): every token's logits, and so its
logprobs, bit-identical whatever else the step computes — the prefix cache's state (a prompt
whose start was cached computes only its last rows), the prefill chunk size, the other
requests of the batch, and preemption (a preempted request recomputes its tokens in other
steps).

Without it a matmul's row count picks its kernel (on CPU: a weight-streaming kernel up to 16
rows, a GEMM beyond; the GEMM's own blocking also depends on the row count), and the kernels
sum in different orders, so the same row gets logits a few float32 ulps apart; in 16-bit
models each rounding of an activation can then flip by one bf16 ulp and the difference grows
through the layers (docs/benchmarks.md: how much, in logprobs). Everything else the model
computes is already row by row (norms, activations, rotary, the sampler's log-softmax).

Here each unquantized linear layer multiplies row by row in one fixed order:
``BatchInvariantLinearMethod`` on the CPU kernels' ``linear_rows``, else (no kernels) one
``torch.nn.functional.linear`` call per row, whose shape then never changes. The attention
backends compute each query token alone in this mode (``AttentionMetadataBuilder``'s
``batch_invariant``). ``use_batch_invariant_methods`` swaps the methods in, once, at load.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.layers.linear import UnquantizedLinearMethod
from pagedllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from pagedllm.platforms import current_platform


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """``UnquantizedLinearMethod``'s weight, multiplied row by row in one fixed order.

    On CPU with the kernels, ``weight`` becomes ``pack_w16`` / ``pack_w32``'s blocked layout
    [ceil(out / 16), in, 16] for ``linear_rows``; elsewhere it stays [out, in] and each row of
    x is its own ``F.linear`` call ([1, in]: the same kernel and blocking for every row).
    """

    float32_copy = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        if weight.dim() != 2:  # prepared already
            return
        if not current_platform.is_cpu or not cpu_kernels.is_available():
            layer.gemm_plan = RowByRowTorchGemm(layer)
            return
        packed = cpu_kernels.pack_w32(weight) if weight.dtype == torch.float32 else cpu_kernels.pack_w16(weight)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.gemm_plan = RowsGemm(layer.weight, layer.output_size_per_partition)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return layer.gemm_plan(x, bias)


class RowsGemm:
    """``linear_rows`` on a ``pack_w16`` / ``pack_w32`` weight for W [n, in] (a GEMM plan,
    see ``cpu_gemm``)."""

    def __init__(self, weight: torch.Tensor, n: int) -> None:
        self.weight, self.n = weight, n

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        y = cpu_kernels.linear_rows(x.reshape(-1, x.shape[-1]), self.weight, bias, self.n)
        return y.view(*x.shape[:-1], self.n)

    def describe(self) -> str:
        return f"{str(self.weight.dtype).removeprefix('torch.')} row by row (batch-invariant, linear_rows)"


class RowByRowTorchGemm:
    """One ``F.linear`` call per row of x on ``layer.weight`` [out, in] ([1, in]: the same
    kernel and blocking for every row; a GEMM plan, see ``cpu_gemm``)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        weight, n = self.layer.weight, self.layer.output_size_per_partition
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_empty(x2.shape[0], n)
        for i in range(x2.shape[0]):
            # NOTE: a fresh [1, in] copy: the row's alignment never changes either.
            y[i] = F.linear(x2[i : i + 1].clone(), weight, bias)[0]
        return y.view(*x.shape[:-1], n)

    def describe(self) -> str:
        return f"{str(self.layer.weight.dtype).removeprefix('torch.')} row by row (batch-invariant, one torch matmul per row)"


def use_batch_invariant_methods(model: nn.Module) -> None:
    """Give every layer of ``model`` whose ``quant_method`` is ``UnquantizedLinearMethod``
    (or its lm_head subclass) a ``BatchInvariantLinearMethod``, before its weights are
    prepared (``process_weights_after_loading``).

    Raises:
        ValueError: a layer with another method (a quantized one): it has no
            batch-invariant kernel.
    """
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            raise ValueError(
                f"--batch-invariant supports unquantized models only: layer {name!r} uses "
                f"{type(method).__name__}, which has no batch-invariant kernel."
            )
        module.quant_method = BatchInvariantLinearMethod()

