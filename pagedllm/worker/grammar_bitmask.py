"""The step's structured-output bitmask, laid out on the sampler's rows (runner side)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.messages.sched_output import SchedulerOutput


def sampled_rows_bitmask(so: SchedulerOutput, order: list[str], sample_reqs: np.ndarray,
                         device: torch.device) -> Optional[torch.Tensor]:
    """The allowed-token bitmask of each sampled row (``SamplingMetadata.allowed_token_bitmask``).

    Args:
        so: the step's scheduler output; rows ``so.structured_output_request_ids[r]`` ..
            of ``so.grammar_bitmask`` belong to request r's sampled positions, in order.
        order: the step's request ids, in the runner's order.
        sample_reqs: [S] int64, the index in ``order`` of each sampled row's request
            (non-decreasing: a request's positions are consecutive).
        device: where the logits are.

    Returns:
        [S, ceil(V / 32)] int32 on ``device``, every bit set on the rows of unconstrained
        requests; None when no row is constrained (nothing to apply, nothing computed).
    """
    if so.grammar_bitmask is None:
        return None
    first = np.searchsorted(sample_reqs, sample_reqs)  # each row's request's first row
    position = (np.arange(len(sample_reqs)) - first).tolist()
    source = [so.structured_output_request_ids.get(order[i], -1) for i in sample_reqs.tolist()]
    source = [src + pos if src >= 0 else -1 for src, pos in zip(source, position)]
    targets = [row for row, src in enumerate(source) if src >= 0]
    if not targets:
        return None
    bitmask = np.full((len(source), so.grammar_bitmask.shape[1]), -1, dtype=np.int32)
    bitmask[targets] = so.grammar_bitmask[[source[row] for row in targets]]
    return torch.from_numpy(bitmask).to(device)
