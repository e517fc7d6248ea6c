"""What a state layer is to the model runner (vLLM's ``MambaBase`` and its per-step
metadata): a layer keeping a fixed-size recurrent state per request in tensors with a
leading slot dimension, which the runner allocates (zeroed) and binds, and the metadata of
each step that says which slot each request of the batch uses.

Each step's requests are laid out as the runner lays them out: decodes (one token each)
first, then prefill chunks, requests contiguous in the flattened tokens::

    tokens:            d0 d1 | p0 p0 p0 p0 | p1 p1 p1
    query_start_loc:   0  1  2             6        9
    state_indices:     s(d0) s(d1) s(p0) s(p1)          (the requests' slots)
    has_initial_state: True True False True             (p1 continues a chunked prefill)

A request whose state starts from zero (no computed token) and runs one token stands among
the decodes; the runner zeroes its slot before the forward (``zero_fresh_states``), so the
decode ops, which always read the state, start it from zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


class MambaBase(nn.Module):
    """A layer with a recurrent state per request (Mamba-2 mixer, gated delta rule).

    A subclass says its state's tensors: ``get_state_shape()`` (one shape per tensor, without
    the slot dimension) and ``get_state_dtype()`` (one dtype per tensor); they must equal
    what its model class's ``get_mamba_state_shape_from_config`` gives, from which the KV-cache
    groups are sized. ``bind_state_caches`` sets ``kv_cache`` (the tensors, [num_slots,
    *shape] each) and ``kv_cache_group_id`` (its group: ``get_forward_context(kv_cache_group_id)``
    is the step's ``MambaMetadata``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache: list[torch.Tensor] = []
        self.kv_cache_group_id = 0

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        raise NotImplementedError


@dataclass
class MambaMetadata:
    """One state group's view of a step (vLLM's ``Mamba2AttentionMetadata``'s fields by the
    shared contract's names); tensors on the model's device.

    Attributes:
        query_start_loc: int32 [num_reqs + 1], request r's tokens are ``query_start_loc[r]
            .. query_start_loc[r + 1]`` of the step's flattened tokens.
        state_indices: int32 [num_reqs], request r's state slot.
        has_initial_state: bool [num_reqs], whether request r has computed tokens before
            this step (its slot holds the state after them).
        num_decodes: the first ``num_decodes`` requests run one token each from their slot.
        num_prefills: the requests after them (chunks of one token or more).
        num_prefill_tokens: the tokens of those, the last ``num_prefill_tokens`` of the step.
    """

    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    num_decodes: int
    num_prefills: int
    num_prefill_tokens: int

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """int32 [num_prefills + 1]: ``query_start_loc`` of the prefills alone (from 0)."""
        return self.query_start_loc[self.num_decodes:] - self.num_decodes


def build_mamba_metadata(
    query_start_loc: np.ndarray, state_indices: np.ndarray, num_computed_tokens: np.ndarray, num_decodes: int,
    device: torch.device,
) -> MambaMetadata:
    """The step's ``MambaMetadata`` from the runner's arrays (requests decodes first):
    ``query_start_loc`` [num_reqs + 1], ``state_indices`` [num_reqs] (slots) and
    ``num_computed_tokens`` [num_reqs] before the step, all integer numpy arrays."""
    num_reqs = len(state_indices)
    num_prefill_tokens = int(query_start_loc[-1] - query_start_loc[num_decodes])
    return MambaMetadata(
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        state_indices=torch.from_numpy(state_indices.astype(np.int32)).to(device),
        has_initial_state=torch.from_numpy(num_computed_tokens > 0).to(device),
        num_decodes=num_decodes,
        num_prefills=num_reqs - num_decodes,
        num_prefill_tokens=num_prefill_tokens,
    )


def zero_fresh_states(layers: list[MambaBase], state_indices: np.ndarray, num_computed_tokens: np.ndarray,
                      num_decodes: int) -> None:
    """Zero, in every tensor of ``layers``, the slots of the decodes (the first ``num_decodes``
    requests) that have no computed token: a one-token prompt, or a request resumed after
    preemption whose first step is one token."""
    fresh = state_indices[:num_decodes][num_computed_tokens[:num_decodes] == 0]
    if not len(fresh):
        return
    for layer in layers:
        index = torch.from_numpy(fresh.astype(np.int64)).to(layer.kv_cache[0].device)
        for tensor in layer.kv_cache:
            tensor.index_fill_(0, index, 0)


def bind_state_caches(layers: list[MambaBase], group_ids: list[int], num_slots: int,
                      device: torch.device) -> list[torch.Tensor]:
    """Allocate each layer's state tensors, [num_slots, *shape] of its ``get_state_shape()`` /
    ``get_state_dtype()``, zeroed, and bind them with its state group ``group_ids[i]``.

    Returns:
        every tensor allocated, layer by layer.
    """
    tensors = []
    for layer, group_id in zip(layers, group_ids):
        layer.kv_cache = [torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                          for shape, dtype in zip(layer.get_state_shape(), layer.get_state_dtype())]
        layer.kv_cache_group_id = group_id
        tensors.extend(layer.kv_cache)
    return tensors
