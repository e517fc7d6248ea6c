"""Logits processors: the ordered transforms the sampler applies to a batch's logits.

Each processor says whether the step's batch needs it (``is_active``) and whether it can
change a row's argmax (``argmax_invariant``). The sampler runs the active processors that
can change the argmax, in list order, before it takes the greedy rows' argmax; the
argmax-invariant ones (temperature, top-k / top-p) run after it, for the random rows only.
The default order follows vLLM V1:

```
logit_bias -> min_tokens -> repetition / frequency / presence penalties
  -> allowed_token_ids -> bad words
  -> allowed-token bitmask (structured outputs)     [greedy rows: argmax here]
  -> temperature -> top-k / top-p                   [random rows]
```

A new transform (a custom processor, a grammar's bitmask) is one more entry in the list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Sequence

import torch

from pagedllm.model_executor.sampling_metadata import SamplingMetadata, pad_token_ids
from pagedllm.sampling_params import _GREEDY_TEMPERATURE

_NEG_INF = float("-inf")


class LogitsProcessor(ABC):
    """One transform of [B, V] logits before sampling.

    ``apply`` receives float32 logits that the sampler owns (a copy of the model's), so it
    may work in place; it returns the transformed [B, V] float32 tensor (the same or a new
    one). It runs only when ``is_active`` is True for the step's metadata; ``is_active`` is
    called every step, so it must be O(1) or close.
    """

    #: True if ``apply`` never changes which token of a row has the largest logit; such a
    #: processor is skipped for greedy rows.
    argmax_invariant: ClassVar[bool] = False

    @abstractmethod
    def is_active(self, metadata: SamplingMetadata) -> bool:
        """Whether any row of this step needs the transform."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Transform ``logits`` [B, V] float32 for the rows of ``metadata``."""


class LogitBiasLogitsProcessor(LogitsProcessor):
    """OpenAI ``logit_bias``: adds each row's ``{token_id: bias}`` to its logits."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return any(metadata.logit_bias)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return apply_logit_bias(logits, metadata.logit_bias)


class MinTokensLogitsProcessor(LogitsProcessor):
    """vLLM's ``min_tokens``: EOS and stop token ids are -inf until a row reached it."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return bool(metadata.min_tokens)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return apply_min_tokens(logits, metadata.min_tokens)


class PenaltiesLogitsProcessor(LogitsProcessor):
    """Repetition, frequency and presence penalties (see ``apply_penalties``)."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return not metadata.no_penalties

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return apply_penalties(logits, metadata)


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """vLLM's ``allowed_token_ids``: tokens outside a row's list become -inf."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return metadata.disallowed_token_mask is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        assert metadata.disallowed_token_mask is not None
        return logits.masked_fill_(metadata.disallowed_token_mask, _NEG_INF)


class BadWordsLogitsProcessor(LogitsProcessor):
    """vLLM's ``bad_words`` (see ``apply_bad_words``)."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return bool(metadata.bad_words_token_ids)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return apply_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)


class AllowedTokenBitmaskLogitsProcessor(LogitsProcessor):
    """Structured outputs: tokens whose bit is clear in
    ``metadata.allowed_token_bitmask`` become -inf."""

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return metadata.allowed_token_bitmask is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        assert metadata.allowed_token_bitmask is not None
        return apply_token_bitmask(logits, metadata.allowed_token_bitmask)


class TemperatureLogitsProcessor(LogitsProcessor):
    """Divides each random row by its temperature (greedy rows of a mixed batch by 1: they
    are sampled too, then discarded, and 1 keeps their arithmetic finite)."""

    argmax_invariant = True

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return not metadata.all_greedy

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        is_greedy = metadata.temperature < _GREEDY_TEMPERATURE
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        return logits.div_(temperature.unsqueeze(1))


class TopKTopPLogitsProcessor(LogitsProcessor):
    """top-k and top-p truncation in one sort (see ``apply_top_k_top_p``)."""

    argmax_invariant = True

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return metadata.top_k is not None or metadata.top_p is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)


def default_logits_processors() -> list[LogitsProcessor]:
    """The processors of every sampler, in order (see the module docstring)."""
    return [
        LogitBiasLogitsProcessor(),
        MinTokensLogitsProcessor(),
        PenaltiesLogitsProcessor(),
        AllowedTokenIdsLogitsProcessor(),
        BadWordsLogitsProcessor(),
        AllowedTokenBitmaskLogitsProcessor(),
        TemperatureLogitsProcessor(),
        TopKTopPLogitsProcessor(),
    ]


def apply_logit_bias(logits: torch.Tensor,
                     logit_bias: Sequence[Optional[dict[int, float]]]) -> torch.Tensor:
    """Add each row's ``{token_id: bias}`` to its logits, in place (OpenAI ``logit_bias``).

    Args:
        logits: [B, V] float32.
        logit_bias: per row, a dict or None.

    Returns:
        ``logits``.
    """
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        index = _index_tensors(rows, cols, logits.device)
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype).to(logits.device),
                          accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor,
                     min_tokens: dict[int, tuple[int, set[int]]]) -> torch.Tensor:
    """Set the blocked ids (EOS and stop token ids) of the listed rows to -inf, in place.

    vLLM's ``min_tokens``: a request cannot stop before it generated that many tokens.

    Args:
        logits: [B, V] float32.
        min_tokens: row -> (min_tokens, blocked token ids); every listed row is blocked.

    Returns:
        ``logits``.
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, (_, blocked) in min_tokens.items():
        rows.extend([row] * len(blocked))
        cols.extend(blocked)
    if rows:
        logits.index_put_(_index_tensors(rows, cols, logits.device),
                          torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device))
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                    output_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Ban the last token of each bad word whose other tokens end the row's output, in
    place (a one-token word is always banned). As vLLM's ``bad_words``: only the output is
    matched, not the prompt.

    Args:
        logits: [B, V] float32.
        bad_words_token_ids: row -> token-id sequences of its bad words.
        output_token_ids: per row, the tokens generated before the sampled position.

    Returns:
        ``logits``.
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, words in bad_words_token_ids.items():
        output = output_token_ids[row]
        for word in words:
            prefix = len(word) - 1
            if prefix <= len(output) and list(output[len(output) - prefix:]) == word[:prefix]:
                rows.append(row)
                cols.append(word[-1])
    if rows:
        logits.index_put_(_index_tensors(rows, cols, logits.device),
                          torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device))
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties, in place.

    Repetition penalty (CTRL, arXiv:1909.05858, as HF transformers'
    ``RepetitionPenaltyLogitsProcessor`` and vLLM): for every token in the prompt or
    the output, ``logit / penalty`` if the logit is > 0, else ``logit * penalty``.

    Frequency and presence penalties (OpenAI API reference, "Parameter details"), over
    the OUTPUT tokens only, with ``count`` the number of times a token was generated:
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

    Args:
        logits: [B, V] float32.
        metadata: uses the three penalty tensors, ``prompt_token_ids`` and
            ``output_token_ids``.

    Returns:
        ``logits``.
    """
    num_rows, vocab_size = logits.shape
    output_ids = pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)
    output_counts = _token_counts(output_ids, vocab_size)
    output_seen = output_counts > 0
    assert metadata.prompt_token_ids is not None, "prompt_token_ids is needed for penalties"
    seen = output_seen | (_token_counts(metadata.prompt_token_ids, vocab_size) > 0)

    penalty = metadata.repetition_penalties.unsqueeze(1).expand(num_rows, vocab_size)
    penalty = torch.where(seen, penalty, 1.0)
    logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))

    logits.sub_(metadata.frequency_penalties.unsqueeze(1) * output_counts)
    logits.sub_(metadata.presence_penalties.unsqueeze(1) * output_seen)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place.

    Args:
        logits: [B, V] float32.
        bitmask: [B, ceil(V / 32)] int32; token t is allowed when bit ``t % 32`` (least
            significant first) of word ``t // 32`` is set (xgrammar's layout).

    Returns:
        ``logits``.
    """
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1)[:, :vocab_size].to(device=logits.device, dtype=torch.bool)
    return logits.masked_fill_(~allowed, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Set every logit outside a row's top-k / top-p set to -inf (one sort per call).

    top-k keeps the tokens whose logit is >= the k-th largest (ties with the k-th are
    kept). top-p (nucleus sampling, Holtzman et al. 2019, arXiv:1904.09751) then keeps,
    of what is left, the smallest most-likely-first set whose probability reaches
    ``top_p``: a token stays when the mass of the tokens before it is < top_p, so the
    top token always stays. top_p >= 1 disables a row.

    Args:
        logits: [B, V] float32 (already divided by temperature).
        top_k: [B] int64 (V disables a row) or None.
        top_p: [B] float32 in (0, 1] or None.

    Returns:
        A new [B, V] float32 tensor.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = (top_k.clamp(1, logits.shape[-1]) - 1).unsqueeze(1)
        sorted_logits.masked_fill_(sorted_logits < sorted_logits.gather(1, kth), _NEG_INF)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # NOTE: rows with top_p = 1 are left alone; float rounding of the cumsum
        # could otherwise drop tail tokens of "disabled" rows.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 occurrences of each token per row of padded [B, L] ids.

    Counts go into V + 1 columns with scatter_add; the last one (the padding) is dropped.
    """
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _index_tensors(rows: list[int], cols: list[int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One host-to-device copy of a (rows, cols) index pair."""
    index = torch.tensor([rows, cols], dtype=torch.int64).to(device)
    return index[0], index[1]
