"""The step's structured-output bitmask, laid out on the sampler's rows (runner side)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.messages.sched_output import SchedulerOutput


def sampled_rows_bitmask(so: SchedulerOutput, sampled_req_ids: list[str],
                         device: torch.device) -> Optional[torch.Tensor]:
    """The allowed-token bitmask of each sampled row (``SamplingMetadata.allowed_token_bitmask``).

    Args:
        so: the step's scheduler output; row ``so.structured_output_request_ids[r]`` of
            ``so.grammar_bitmask`` belongs to request r.
        sampled_req_ids: the request of each sampled row, in the sampler's order.
        device: where the logits are.

    Returns:
        [len(sampled_req_ids), ceil(V / 32)] int32 on ``device``, every bit set on the rows
        of unconstrained requests; None when no row is constrained (nothing to apply).
    """
    if so.grammar_bitmask is None:
        return None
    source = [so.structured_output_request_ids.get(req_id, -1) for req_id in sampled_req_ids]
    targets = [row for row, src in enumerate(source) if src >= 0]
    if not targets:
        return None
    bitmask = np.full((len(source), so.grammar_bitmask.shape[1]), -1, dtype=np.int32)
    bitmask[targets] = so.grammar_bitmask[[source[row] for row in targets]]
    return torch.from_numpy(bitmask).to(device)
