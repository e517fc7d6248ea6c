"""Batched sampling: logits of B rows -> one token each, plus logprobs.

The order of operations follows vLLM V1's sampler:

```
logits [B, V] --float32--> raw logprobs (log_softmax, kept for the output)
   |
   +-> logits processors that can change the argmax, in order
   |   (logit_bias -> min_tokens -> penalties -> allowed-token bitmask -> custom ones)
   |
   +-> greedy rows: argmax
   +-> random rows: argmax-invariant processors (temperature -> top-k / top-p)
                    -> softmax -> min_p -> exponential race: argmax(probs / q), q ~ Exp(1)
```

The processors live in ``logits_processors``; the sampler owns the ordered list, so a new
transform is one more entry. When every row is greedy, no logprobs are wanted and no
processor is active, the sampler takes the argmax of the model's logits directly.
Everything is vectorised over the batch and device-agnostic: the only per-row Python work
is in the sparse per-request inputs (logit bias, min_tokens, output token lists) and one
random draw per seeded row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.model_executor.custom_op import CustomOp
from pagedllm.model_executor.layers.logits_processors import LogitsProcessor, default_logits_processors
from pagedllm.model_executor.sampling_metadata import SamplingMetadata
from pagedllm.sampling_params import _GREEDY_TEMPERATURE



@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of B rows.

    Attributes:
        sampled_token_ids: [B] int64.
        logprob_token_ids: [B, max_num_logprobs + 1] int64: column 0 is the sampled
            token, then the top-k tokens by descending logprob; None without logprobs.
        logprobs: [B, max_num_logprobs + 1] float32 natural-log probabilities of those
            tokens under the raw logits; None without logprobs.
        ranks: [B] int64, 1-based rank of the sampled token; None without logprobs.

    A row that asked for fewer logprobs than ``max_num_logprobs`` uses only its first
    ``1 + logprobs`` columns.
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    ranks: Optional[torch.Tensor] = None


class Argmax(CustomOp):
    """argmax of each row of logits [B, V] (any float dtype) -> [B] int64; the first index
    on ties (and the first NaN, as ``torch.argmax``)."""

    def forward_native(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def forward_cpu(self, logits: torch.Tensor) -> torch.Tensor:
        """The vectorised C++ kernel (PyTorch's CPU argmax of bf16 is scalar) for [B, V]
        rows with a contiguous last dimension."""
        if logits.dim() == 2 and logits.stride(-1) == 1:
            return cpu_kernels.argmax_rows(logits)
        return self.forward_native(logits)




class Sampler(torch.nn.Module):
    """Samples one token per row from [B, V] logits (see the module docstring).

    Args:
        logits_processors: the transforms, in order; ``default_logits_processors()`` when
            None. ``self.logits_processors`` may be edited later (e.g. to insert one).
    """

    def __init__(self, logits_processors: Optional[list[LogitsProcessor]] = None) -> None:
        super().__init__()
        self.logits_processors = (default_logits_processors() if logits_processors is None
                                  else logits_processors)
        self.greedy_sample = Argmax()

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample the token of each row.

        Args:
            logits: [B, V] any float dtype, on any device; not modified.
            metadata: this step's ``SamplingMetadata`` (tensors on ``logits.device``).

        Returns:
            ``SamplerOutput``; its logprobs (when asked for) come from the raw logits,
            before bias, penalties and temperature, as vLLM V1 returns by default.
        """
        active = [p for p in self.logits_processors if p.is_active(metadata)]
        argmax_changing = [p for p in active if not p.argmax_invariant]
        if metadata.all_greedy and metadata.max_num_logprobs is None and not argmax_changing:
            # Plain greedy: nothing modifies the logits, so no copy is needed.
            return SamplerOutput(sampled_token_ids=self.greedy_sample(logits))
        # NOTE: one copy up front, so every processor may work in place without
        # touching the caller's tensor.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = (None if metadata.max_num_logprobs is None
                        else torch.log_softmax(logits, dim=-1))
        logits = self._apply(logits, metadata, argmax_changing)
        sampled = self._sample(logits, metadata, [p for p in active if p.argmax_invariant])

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        token_ids, logprobs, ranks = compute_logprobs_with_topk(
            raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    @staticmethod
    def _apply(logits: torch.Tensor, metadata: SamplingMetadata,
               processors: list[LogitsProcessor]) -> torch.Tensor:
        for processor in processors:
            logits = processor.apply(logits, metadata)
        return logits

    def target_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each row samples from: every processor, softmax and min-p
        applied; a greedy row is one-hot at its argmax (for speculative decoding's rejection
        sampler, which needs p itself rather than a sample).

        Args:
            logits: [B, V] any float dtype; not modified.
            metadata: this step's ``SamplingMetadata``.

        Returns:
            [B, V] float32, each row summing to 1.
        """
        active = [p for p in self.logits_processors if p.is_active(metadata)]
        logits = self._apply(logits.to(torch.float32, copy=True), metadata,
                             [p for p in active if not p.argmax_invariant])
        one_hot = torch.zeros_like(logits).scatter_(1, self.greedy_sample(logits).unsqueeze(1), 1.0)
        probs = self._random_probs(logits, metadata, [p for p in active if p.argmax_invariant])
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.where((metadata.temperature < _GREEDY_TEMPERATURE).unsqueeze(1), one_hot, probs)

    def _random_probs(self, logits: torch.Tensor, metadata: SamplingMetadata,
                      argmax_invariant: list[LogitsProcessor]) -> torch.Tensor:
        """Unnormalised probabilities of the random rows: temperature, top-k / top-p,
        softmax, min-p (``logits`` is modified)."""
        probs = torch.softmax(self._apply(logits, metadata, argmax_invariant), dim=-1)
        if metadata.min_p is not None:
            probs = apply_min_p(probs, metadata.min_p)
        return probs

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                argmax_invariant: list[LogitsProcessor]) -> torch.Tensor:
        greedy = None if metadata.all_random else self.greedy_sample(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        probs = self._random_probs(logits, metadata, argmax_invariant)
        sampled = exponential_race(probs, metadata.generators)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < _GREEDY_TEMPERATURE, greedy, sampled)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below ``min_p`` x the row's top probability, in place.

    min-p sampling (Nguyen et al., arXiv:2407.01082). The result is not renormalised:
    the exponential race below does not need it.

    Args:
        probs: [B, V] float32.
        min_p: [B] float32 in [0, 1]; 0 disables a row.

    Returns:
        ``probs``.
    """
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill_(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor,
                     generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row: ``argmax(probs / q)`` with ``q ~ Exponential(1)``.

    This is a sample from the (unnormalised) categorical ``probs`` without a host sync
    (the Gumbel-max trick in exponential form). Rows with a generator draw their q from
    it alone, so their tokens do not depend on the other rows; the rest share one
    batched draw from the default generator.

    Args:
        probs: [B, V] float32, non-negative, not necessarily normalised.
        generators: row -> generator on ``probs.device``.

    Returns:
        [B] int64 token ids.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # NOTE: q == 0 would turn a zero-probability token into 0/0 = NaN, and argmax
    # picks NaN; the clamp makes that impossible.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def compute_logprobs_with_topk(logprobs: torch.Tensor, token_ids: torch.Tensor,
                               k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the logprob of given tokens plus the top-k of each row (vLLM's format).

    Used for sampled tokens and, by the runner, for prompt logprobs.

    Args:
        logprobs: [N, V] float32 log-probabilities (log_softmax of raw logits).
        token_ids: [N] integer, the token whose logprob and rank each row reports.
        k: number of top entries, 0 <= k <= V.

    Returns:
        (token_ids [N, k + 1] int64, logprobs [N, k + 1] float32, ranks [N] int64):
        column 0 is ``token_ids``, columns 1.. the top-k by descending logprob; rank is
        1 + the number of vocabulary entries with a strictly greater logprob.
    """
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return (torch.cat([token_ids, top_ids], dim=1),
            torch.cat([token_logprobs, top_logprobs], dim=1),
            ranks)
