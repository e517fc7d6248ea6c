"""``SamplingMetadata``: what the sampler and its logits processors read for one step.

The model runner takes it as a view of its persistent batch (``InputBatch.sampling_metadata``);
``SamplingMetadata.from_params`` builds one from scratch, the reference the view is tested
against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for a batch of B rows (one row per sampled position).

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
        output_token_ids: per row, the tokens generated before the sampled position;
            empty lists if ``no_penalties`` and no row has bad words (nothing reads them then).
        min_tokens: row -> (min_tokens, token ids to block: EOS + stop_token_ids), only
            for rows that have generated fewer than min_tokens tokens. Every listed row
            is blocked.
        logit_bias: per row, token id -> value added to its logit, or None.
        max_num_logprobs: max over rows of ``SamplingParams.logprobs``; None if no row
            wants logprobs.
        allowed_token_bitmask: [B, ceil(V / 32)] int32, or None: bit ``t % 32`` of word
            ``t // 32`` set means token t is allowed (structured outputs fill it).
        disallowed_token_mask: [B, V] bool, True for the tokens outside a row's
            ``allowed_token_ids`` (all False for a row without them); None when no row
            sets them.
        bad_words_token_ids: row -> its ``SamplingParams.bad_words_token_ids``, for the
            rows that have bad words.
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
    allowed_token_bitmask: Optional[torch.Tensor] = None
    disallowed_token_mask: Optional[torch.Tensor] = None
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)

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
        bad_words = {row: p.bad_words_token_ids for row, p in enumerate(params) if p.bad_words_token_ids}
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
                              pad_token_ids(prompt_token_ids, vocab_size, device)),
            output_token_ids=([[] for _ in params] if no_penalties and not bad_words
                              else [list(ids) for ids in output_token_ids]),
            min_tokens=_rows_under_min_tokens(params, output_token_ids, eos_token_id),
            logit_bias=[p.logit_bias or None for p in params],
            max_num_logprobs=max(requested) if requested else None,
            disallowed_token_mask=disallowed_token_mask([p.allowed_token_ids for p in params], vocab_size, device),
            bad_words_token_ids=bad_words,
        )


def min_tokens_blocked_ids(params: SamplingParams, eos_token_id: Optional[int]) -> set[int]:
    """The ids a request may not sample before ``min_tokens``: its stop token ids, and EOS
    unless it sets ``ignore_eos``."""
    blocked = set(params.stop_token_ids or [])
    if eos_token_id is not None and not params.ignore_eos:
        blocked.add(eos_token_id)
    return blocked


def disallowed_token_mask(allowed_token_ids: Sequence[Optional[Sequence[int]]], vocab_size: int,
                          device: torch.device | str) -> Optional[torch.Tensor]:
    """[B, V] bool, True for the tokens a row may not sample: those outside its
    ``allowed_token_ids`` (a row with None allows every token); None when no row has any."""
    if not any(allowed_token_ids):
        return None
    mask = torch.zeros(len(allowed_token_ids), vocab_size, dtype=torch.bool)
    for row, allowed in enumerate(allowed_token_ids):
        if allowed:
            mask[row] = True
            mask[row, list(allowed)] = False
    return mask.to(device)


def pad_token_ids(rows: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64 of the rows, padded with ``vocab_size`` (an unused id)."""
    max_len = max((len(r) for r in rows), default=0)
    padded = [list(r) + [vocab_size] * (max_len - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(rows), max_len).to(device)


def _rows_under_min_tokens(
    params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
    eos_token_id: Optional[int],
) -> dict[int, tuple[int, set[int]]]:
    """row -> (min_tokens, EOS + stop_token_ids) for rows still short of min_tokens."""
    return {row: (p.min_tokens, min_tokens_blocked_ids(p, eos_token_id))
            for row, p in enumerate(params) if len(output_token_ids[row]) < p.min_tokens}
