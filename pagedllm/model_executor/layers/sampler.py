"""Batched sampling: logits of B requests -> one next token each, plus logprobs.

The order of operations follows vLLM V1's sampler:

```
logits [B, V] --float32--> raw logprobs (log_softmax, kept for the output)
   |
   +-> logit_bias -> min_tokens -> repetition / frequency / presence penalties
   |
   +-> greedy rows: argmax
   +-> random rows: / temperature -> top_k -> top_p -> softmax -> min_p
                    -> exponential race: argmax(probs / q), q ~ Exp(1)
```

Everything is vectorised over the batch and device-agnostic: the only per-row Python
work is turning the sparse per-request inputs (logit bias, min_tokens, output token
lists) into index tensors, and one random draw per seeded row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.sampling_params import _GREEDY_TEMPERATURE, SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for a batch of B requests (built by the model runner).

    All tensors live on the device of the logits; every generator too.

    Attributes:
        temperature: [B] float32; below 1e-5 (0.0 by convention) means greedy for that row.
        all_greedy: every row is greedy (random sampling is skipped).
        all_random: no row is greedy (the argmax pass is skipped).
        top_p: [B] float32 in (0, 1], or None when no row uses it (1.0 disables a row).
        top_k: [B] int64, vocab_size where disabled, or None when no row uses it.
        min_p: [B] float32 in [0, 1], or None when no row uses it (0.0 disables a row).
        generators: row index -> generator, for rows with a seed. The runner keeps one
            generator per request across steps so that a seeded request's tokens do not
            depend on the batch it runs in.
        no_penalties: no row uses presence, frequency or repetition penalties.
        presence_penalties: [B] float32 (0.0 disables).
        frequency_penalties: [B] float32 (0.0 disables).
        repetition_penalties: [B] float32 (1.0 disables).
        prompt_token_ids: [B, max_prompt_len] int64 padded with vocab_size; None if
            ``no_penalties``.
        output_token_ids: per row, the tokens generated so far (before this step); empty
            lists if ``no_penalties`` (nothing reads them then).
        min_tokens: row -> (min_tokens, token ids to block: EOS + stop_token_ids), only
            for rows that have generated fewer than min_tokens tokens. Every listed row
            is blocked; the runner drops a row once it has reached its minimum.
        logit_bias: per row, token id -> value added to its logit, or None.
        max_num_logprobs: max over rows of ``SamplingParams.logprobs``; None if no row
            wants logprobs.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]
    min_p: Optional[torch.Tensor]
    generators: dict[int, torch.Generator]
    no_penalties: bool
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    prompt_token_ids: Optional[torch.Tensor]
    output_token_ids: list[list[int]]
    min_tokens: dict[int, tuple[int, set[int]]]
    logit_bias: list[Optional[dict[int, float]]]
    max_num_logprobs: Optional[int]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: Optional[dict[int, torch.Generator]] = None,
        eos_token_id: Optional[int] = None,
    ) -> "SamplingMetadata":
        """Build the metadata of one step from scratch (simple, not incremental).

        Args:
            params: one ``SamplingParams`` per row.
            prompt_token_ids: per row, the prompt's token ids.
            output_token_ids: per row, the tokens generated before this step.
            vocab_size: V, the logits' last dimension.
            device: where the tensors go (the logits' device).
            generators: row -> generator for seeded rows, kept by the caller across
                steps (on ``device``).
            eos_token_id: blocked with ``stop_token_ids`` while a row is under its
                ``min_tokens``, unless the row sets ``ignore_eos``.
        """
        greedy = [p.is_greedy for p in params]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        no_penalties = all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0
            for p in params
        )
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=column([0.0 if g else p.temperature for g, p in zip(greedy, params)],
                               torch.float32),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=(column([p.top_p for p in params], torch.float32)
                   if any(p.top_p < 1.0 for p in params) else None),
            top_k=(column([p.top_k if p.top_k > 0 else vocab_size for p in params],
                          torch.int64)
                   if any(p.top_k > 0 for p in params) else None),
            min_p=(column([p.min_p for p in params], torch.float32)
                   if any(p.min_p > 0.0 for p in params) else None),
            generators=dict(generators or {}),
            no_penalties=no_penalties,
            presence_penalties=column([p.presence_penalty for p in params], torch.float32),
            frequency_penalties=column([p.frequency_penalty for p in params], torch.float32),
            repetition_penalties=column([p.repetition_penalty for p in params],
                                        torch.float32),
            prompt_token_ids=(None if no_penalties else
                              _pad_token_ids(prompt_token_ids, vocab_size, device)),
            output_token_ids=([[] for _ in params] if no_penalties else [list(ids) for ids in output_token_ids]),
            min_tokens=_rows_under_min_tokens(params, output_token_ids, eos_token_id),
            logit_bias=[p.logit_bias or None for p in params],
            max_num_logprobs=max(requested) if requested else None,
        )


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


class Sampler(torch.nn.Module):
    """Samples one token per row from [B, V] logits (see the module docstring)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample the next token of each row.

        Args:
            logits: [B, V] any float dtype, on any device; not modified.
            metadata: this step's ``SamplingMetadata`` (tensors on ``logits.device``).

        Returns:
            ``SamplerOutput``; its logprobs (when asked for) come from the raw logits,
            before bias, penalties and temperature, as vLLM V1 returns by default.
        """
        if (metadata.all_greedy and metadata.max_num_logprobs is None and metadata.no_penalties
                and not metadata.min_tokens and not any(metadata.logit_bias)):
            # Plain greedy: nothing modifies the logits, so no copy is needed.
            return SamplerOutput(sampled_token_ids=greedy_sample(logits))
        # NOTE: one copy up front, so every later step may work in place without
        # touching the caller's tensor.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = (None if metadata.max_num_logprobs is None
                        else torch.log_softmax(logits, dim=-1))

        logits = apply_logit_bias(logits, metadata.logit_bias)
        logits = apply_min_tokens(logits, metadata.min_tokens)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        sampled = self._sample(logits, metadata)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        token_ids, logprobs, ranks = compute_logprobs_with_topk(
            raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None if metadata.all_random else greedy_sample(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        is_greedy = metadata.temperature < _GREEDY_TEMPERATURE
        # Greedy rows of a mixed batch are sampled too (then discarded); temperature 1
        # keeps their arithmetic finite.
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits.div_(temperature.unsqueeze(1))
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        if metadata.min_p is not None:
            probs = apply_min_p(probs, metadata.min_p)
        sampled = exponential_race(probs, metadata.generators)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row of logits [B, V] (any float dtype) -> [B] int64; the first index
    on ties. On CPU the vectorised C++ kernel (PyTorch's CPU argmax of bf16 is scalar)."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and cpu_kernels.usable(logits):
        return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


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
    output_ids = _pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)
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


def _rows_under_min_tokens(
    params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
    eos_token_id: Optional[int],
) -> dict[int, tuple[int, set[int]]]:
    """row -> (min_tokens, EOS + stop_token_ids) for rows still short of min_tokens."""
    rows: dict[int, tuple[int, set[int]]] = {}
    for row, p in enumerate(params):
        if len(output_token_ids[row]) < p.min_tokens:
            blocked = set(p.stop_token_ids or [])
            if eos_token_id is not None and not p.ignore_eos:
                blocked.add(eos_token_id)
            rows[row] = (p.min_tokens, blocked)
    return rows


def _pad_token_ids(rows: Sequence[Sequence[int]], vocab_size: int,
                   device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64 of the rows, padded with ``vocab_size`` (an unused id)."""
    max_len = max((len(r) for r in rows), default=0)
    padded = [list(r) + [vocab_size] * (max_len - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(rows), max_len).to(device)


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
