"""Which multimodal items' encoder outputs the model runner holds (plain Python; no torch),
as vLLM's ``EncoderCacheManager``.

The cache is counted in embeddings (``PlaceholderRange.num_embeds``: one per placeholder
token, or per flagged one of an item whose run also holds other tokens), ``cache_size`` of them. An
item enters when the scheduler schedules its encoder run (``allocate``), keyed by its content
hash, so two requests with the same image share one entry; each request that needs it holds a
reference until every chunk of its placeholder tokens has run (``free_encoder_input``). An
entry nobody references stays (a later request, or a preempted one recomputing, reuses it)
until its room is needed: then it is evicted, oldest first, and its hash is reported once by
``get_freed_mm_hashes``, so the runner drops the same tensors.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.core.request import Request


class EncoderCacheManager:
    """Args:
        cache_size: embeddings the cache holds (at least the largest item's).
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        #: mm_hash -> the (request id, item index) that still need it.
        self.cached: dict[str, set[tuple[str, int]]] = {}
        #: Unreferenced entries, oldest first: mm_hash -> its size in embeddings.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether item ``input_id`` of ``request`` is cached; if so the request now references it."""
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash not in self.cached:
            return False
        self.cached[mm_hash].add((request.request_id, input_id))
        self.freeable.pop(mm_hash, None)
        return True

    def can_allocate(self, num_embeds: int) -> bool:
        """Whether an item of ``num_embeds`` embeddings fits, counting the room that evicting
        unreferenced entries would free (nothing is evicted here)."""
        return num_embeds <= self.num_free_slots + sum(self.freeable.values())

    def allocate(self, request: Request, input_id: int) -> None:
        """Enter item ``input_id`` of ``request`` (its encoder runs this step), evicting the
        oldest unreferenced entries for room (an item already entered gains a reference).

        Raises:
            ValueError: it does not fit (``can_allocate`` was not asked).
        """
        feature = request.mm_features[input_id]
        if feature.identifier in self.cached:  # the same image twice in one step: one entry
            self.cached[feature.identifier].add((request.request_id, input_id))
            self.freeable.pop(feature.identifier, None)
            return
        size = feature.mm_position.num_embeds
        if not self.can_allocate(size):
            raise ValueError(f"An item of {size} embeddings does not fit in the encoder cache ({self.cache_size}).")
        while self.num_free_slots < size:
            mm_hash, freed_size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.num_free_slots += freed_size
            self.freed.append(mm_hash)
        self.cached[feature.identifier] = {(request.request_id, input_id)}
        self.num_free_slots -= size

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """``request`` no longer needs item ``input_id`` (its placeholder tokens are computed,
        or it finished or was preempted): the entry becomes evictable once nobody references it."""
        feature = request.mm_features[input_id]
        holders = self.cached.get(feature.identifier)
        if holders is None or (request.request_id, input_id) not in holders:
            return
        holders.discard((request.request_id, input_id))
        if not holders:
            self.freeable[feature.identifier] = feature.mm_position.num_embeds

    def free(self, request: Request) -> None:
        """Drop every reference ``request`` holds."""
        for input_id in range(len(request.mm_features)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """The hashes evicted since the last call (the runner drops their tensors)."""
        freed, self.freed = self.freed, []
        return freed


def schedule_encoder_inputs(
    manager: EncoderCacheManager, request: Request, num_computed_tokens: int, num_new_tokens: int,
    encoder_budget: int, disable_chunked_mm_input: bool = False,
) -> tuple[list[int], int, int]:
    """The encoder runs a step needs for ``request``'s tokens ``num_computed_tokens`` ..
    ``+ num_new_tokens``, as vLLM's ``_try_schedule_encoder_inputs``: each item whose
    placeholder tokens overlap them and that is not cached runs, if its embeddings (``num_embeds``) fit in
    ``encoder_budget`` (embeddings the step's encoder may still compute) and in the cache;
    otherwise the step stops before that item's first token (0 tokens when it is the first).
    Items whose tokens are all computed are skipped (their KV exists); a cached item gains this
    request's reference. With ``disable_chunked_mm_input`` the step also stops before an item
    whose tokens it would not reach the end of (0 tokens when it starts inside that item).

    Returns:
        (indices of the items to run, the tokens the request may compute, the budget left);
        nothing is allocated: the caller allocates the items once the step takes the request.
    """
    to_run: list[int] = []
    end = num_computed_tokens + num_new_tokens
    for i, feature in enumerate(request.mm_features):
        start, length = feature.mm_position.offset, feature.mm_position.length
        num_embeds = feature.mm_position.num_embeds
        if start >= end:
            break
        if start + length <= num_computed_tokens:
            continue
        if disable_chunked_mm_input and end < start + length:
            return to_run, max(start - num_computed_tokens, 0), encoder_budget
        if manager.check_and_update_cache(request, i):
            continue
        if num_embeds > encoder_budget or not manager.can_allocate(num_embeds + sum(
                request.mm_features[j].mm_position.num_embeds for j in to_run)):
            return to_run, max(start - num_computed_tokens, 0), encoder_budget
        to_run.append(i)
        encoder_budget -= num_embeds
    return to_run, num_new_tokens, encoder_budget


def free_computed_encoder_inputs(manager: EncoderCacheManager, request: Request) -> None:
    """Drop ``request``'s references to the items whose placeholder tokens are all computed
    (``num_computed_tokens``): no later chunk reads their embeddings."""
    for i, feature in enumerate(request.mm_features):
        if feature.mm_position.end <= request.num_computed_tokens:
            manager.free_encoder_input(request, i)
