"""Continuous-batching scheduler with chunked prefill and preemption by recompute (no torch).

There are no prefill or decode phases: each request has ``num_tokens -
num_computed_tokens`` tokens still to compute, and one token budget
(``max_num_batched_tokens``) is shared by all requests in a step. Running requests are
served first (FCFS), then waiting ones; a prompt longer than the remaining budget is cut
into chunks. When blocks run out, the newest running request is preempted: its blocks are
freed and it returns to the front of the waiting queue to be recomputed (vLLM V1). With
prefix caching in a model with state layers, a chunk that would pass the request's save
point ends there, so its state is saved at a block boundary
(``KVCacheManager.align_to_save_point``).

Scheduling policy (``SchedulerConfig.policy``, ``pagedllm.core.request_queue``): with
"fcfs" requests wait in arrival order, as above. With "priority" the waiting queue is
ordered by ``(priority, arrival_time)``, lower first; the running requests are kept in
that order too, so the request preempted for blocks is the lowest-priority one (the
newest among equals), and a running request whose prompt is still in prefill yields the
step to a waiting request of a strictly higher priority: its next chunk gets what the
waiting requests leave of the budget. ``max_num_active_seqs`` caps the requests admitted
to RUNNING (``SchedulerConfig.max_running_reqs``).

With LoRA, at most ``max_loras`` distinct adapters are among the running requests (so a
step never needs more device slots). A waiting request whose adapter would exceed that
stays at the front of the queue; behind it only base-model requests may start, so the
running adapters drain and it gets in (no starvation).

Speculative decoding: a running request whose known tokens are all computed but its last
brings the draft tokens the runner proposed (``Request.spec_token_ids``); the scheduler
budgets ``1 + k`` tokens for it and lists the drafts in
``SchedulerOutput.scheduled_spec_decode_tokens``. Drafts are not the request's tokens: the
block manager never hashes them, and after the step ``num_computed_tokens`` is rolled back
by the rejected ones, whose KV slots the next step overwrites. With ``enable_adaptive_k``
(``pagedllm.core.spec_length``) each request's number of drafts is chosen per step from
its measured acceptance and the measured cost of drafting, and sent in
``SchedulerOutput.num_speculative_tokens``.

Micro-batches in flight (pipeline parallelism, ``pagedllm.engine.batch_queue``): a request
stays *in flight* from the ``schedule`` that includes it to the ``update_from_output`` of
that step, and is neither scheduled again meanwhile (its next token, or its next prompt
chunk, waits for that step) nor chosen as a preemption victim. With one step at a time
nothing is in flight while ``schedule`` runs, so this changes nothing there.

Second KV tier (``--kv-offloading-size``, ``pagedllm.core.kv_offload``): a waiting request
whose prefix-cache lookup continues in the tier gets blocks for those hits and waits in
WAITING_FOR_REMOTE_KVS while the workers load them (other requests keep running); when the
runner reports its loads done (``ModelRunnerOutput.finished_recving``) it goes back to the
front of the waiting queue with those tokens computed. The step's tier transfers travel in
``SchedulerOutput.kv_transfers``.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import TYPE_CHECKING, Iterable, Optional

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.encoder_cache_manager import (
    EncoderCacheManager,
    free_computed_encoder_inputs,
    schedule_encoder_inputs,
)
from pagedllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import RequestQueue, create_request_queue, priority_key
from pagedllm.core.spec_length import SpeculationLength
from pagedllm.messages.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.messages.engine_core import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedllm.messages.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from pagedllm.distributed.kv_transfer.base import KVConnectorScheduler
    from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

#: Longest wait (seconds) for a grammar compile in a step that has nothing else to run.
_GRAMMAR_POLL_S = 0.005


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        scheduler_config: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``.
        kv_cache_manager: owns the blocks.
        max_loras: distinct LoRA adapters allowed among the running requests (None: LoRA off).
        speculative_config: speculative decoding, or None. With a draft model every
            allocation reserves ``num_speculative_tokens`` lookahead slots, where the draft
            model writes the KV of its proposals.
        structured_output_manager: compiles constraints and fills the step's token bitmask
            (structured outputs); None: a request with a constraint is refused.
        use_pp: pipeline parallelism: each scheduled request's tokens of the step go in
            ``CachedRequestData.new_token_ids`` (stages before the last sample nothing).
        encoder_cache_size: an image-text model's encoder budget, in embeddings: what the
            encoder may compute in one step and what the encoder cache holds
            (``pagedllm.core.encoder_cache_manager``); None: a text-only model.
        kv_connector: the scheduler side of a KV connector (a prefill / decode split,
            ``pagedllm.distributed.kv_transfer``): a waiting request may get the KV of some
            tokens from a remote engine, and each step's ``kv_connector_metadata`` lists the
            loads and saves; None: no split.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_loras: Optional[int] = None,
        speculative_config: Optional[SpeculativeConfig] = None,
        structured_output_manager: Optional[StructuredOutputManager] = None,
        use_pp: bool = False,
        encoder_cache_size: Optional[int] = None,
        kv_connector: Optional[KVConnectorScheduler] = None,
    ) -> None:
        self.config = scheduler_config
        self.max_loras = max_loras
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_running_reqs = scheduler_config.max_running_reqs
        self.policy = scheduler_config.policy
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.chunked_prefill_enabled = scheduler_config.chunked_prefill_enabled
        self.kv_cache_manager = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        # Requests whose grammar failed to compile: reported (aborted) by the next update.
        self._failed_grammar: list[Request] = []
        # Unfinished requests with a constraint: without any, a step skips structured outputs.
        self._num_constrained = 0
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Second KV tier: requests whose hits are loading, and those loaded, waiting to run.
        self.waiting_for_kvs: dict[str, Request] = {}
        self._kvs_loaded: set[str] = set()
        self.use_pp = use_pp
        # Ids of the requests in a scheduled step whose output is not back yet.
        self.in_flight: set[str] = set()
        self.num_preemptions = 0
        self._num_preemptions_reported = 0
        # Highest number of requests running at once (for memory-efficiency checks).
        self.max_num_running_observed = 0
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.num_lookahead_tokens = (self.num_spec_tokens
                                     if speculative_config and speculative_config.uses_draft_model else 0)
        self.spec_length: Optional[SpeculationLength] = None
        if speculative_config is not None and speculative_config.enable_adaptive_k:
            self.spec_length = SpeculationLength(self.num_spec_tokens, speculative_config.adaptive_k_ema_alpha,
                                                 speculative_config.prior_draft_token_cost)
        self.max_num_encoder_input_tokens = encoder_cache_size or 0
        self.encoder_cache_manager = EncoderCacheManager(encoder_cache_size) if encoder_cache_size else None
        self.kv_connector = kv_connector
        # perf_counter() when the last schedule() returned, and whether its step was decodes only.
        self._step_started = (0.0, False)

    def add_request(self, engine_request: EngineCoreRequest) -> None:
        request = Request(engine_request, self.max_model_len)
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError("This scheduler has no structured output manager: structured_outputs is refused.")
            request.structured_output_request = self.structured_output_manager.make_request(constraint)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._num_constrained += 1
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def schedule(self, max_num_reqs: Optional[int] = None) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their blocks; at most
        ``max_num_reqs`` requests (None: ``max_num_seqs``; a micro-batch's share)."""
        now = time.time()
        max_num_reqs = max_num_reqs or self.max_num_seqs
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        spec_tokens: dict[str, list[int]] = {}
        preempted_any = False
        encoder_budget = self.max_num_encoder_input_tokens
        encoder_inputs: dict[str, list[int]] = {}

        waiting_for_grammar: list[Request] = []
        yielded: list[Request] = []  # prefills that yield to a higher-priority waiting request
        if self.policy == "priority":
            self.running.sort(key=priority_key)
        req_index = 0
        while req_index < len(self.running) and token_budget > 0 and len(num_scheduled_tokens) < max_num_reqs:
            request = self.running[req_index]
            if request.request_id in self.in_flight:
                req_index += 1
                continue
            if self._yields_to_waiting(request):
                yielded.append(request)
                req_index += 1
                continue
            num_known = request.num_tokens - request.num_computed_tokens
            num_new_tokens = self.kv_cache_manager.align_to_save_point(
                request, request.num_computed_tokens, min(num_known + len(request.spec_token_ids), token_budget))
            to_encode, num_new_tokens, budget_left = self._encoder_inputs(request, request.num_computed_tokens,
                                                                          num_new_tokens, encoder_budget)
            if num_new_tokens == 0:
                req_index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self._lookahead(request.num_computed_tokens + num_new_tokens))
                if new_blocks is not None:
                    break
                victim = self._preemption_victim(req_index)
                self._preempt(victim, now)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            self._add_cached(request, num_new_tokens, new_blocks.get_block_ids(), cached, spec_tokens)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            encoder_budget = self._allocate_encoder_inputs(request, to_encode, encoder_inputs, budget_left, encoder_budget)
            token_budget -= num_new_tokens
            req_index += 1

        running_loras = {r.lora_key for r in self.running if r.lora_key is not None}
        lora_waiters: list[Request] = []  # skipped for want of a LoRA slot, in queue order
        skipped: list[Request] = []  # both kinds, in queue order
        while (
            not preempted_any
            and self.waiting
            and token_budget > 0
            and len(self.running) < self.max_running_reqs
            and len(num_scheduled_tokens) < max_num_reqs
        ):
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(request):
                self.waiting.pop_request()
                if not request.is_finished:
                    waiting_for_grammar.append(request)
                    skipped.append(request)
                continue
            if request.lora_key is not None and (lora_waiters or not self._lora_fits(request.lora_key, running_loras)):
                lora_waiters.append(self.waiting.pop_request())
                skipped.append(request)
                continue
            num_external_tokens = 0
            if request.request_id in self._kvs_loaded:  # it holds its hits' blocks already
                hit_blocks, num_hit_tokens = self.kv_cache_manager.empty_blocks, request.num_computed_tokens
            else:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                num_offloaded = self.kv_cache_manager.get_num_offloaded_hit_tokens(request, num_hit_tokens)
                if num_offloaded:
                    if not self._load_offloaded(request, hit_blocks, num_hit_tokens, num_offloaded):
                        break
                    continue
                if self.kv_connector is not None:  # a decode instance: the prompt's KV comes from the prefill one
                    num_external_tokens = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
                    num_hit_tokens += num_external_tokens  # from here on, including tokens not computed here
            num_new_tokens = self.kv_cache_manager.align_to_save_point(
                request, num_hit_tokens, min(request.num_tokens - num_hit_tokens, token_budget))
            to_encode, num_new_tokens, budget_left = self._encoder_inputs(request, num_hit_tokens, num_new_tokens,
                                                                          encoder_budget)
            if num_new_tokens == 0:
                break  # its next image does not fit in this step's encoder budget
            if not self.chunked_prefill_enabled and num_new_tokens < request.num_tokens - num_hit_tokens:
                break  # an encoder's prompt runs whole: it waits for a step with room
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_external_tokens + num_new_tokens, hit_blocks,
                                                              self._lookahead(num_hit_tokens + num_new_tokens))
            if new_blocks is None:
                break
            if num_external_tokens and self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(request, num_external_tokens)
            self.waiting.pop_request()
            self._kvs_loaded.discard(request.request_id)
            request.status = RequestStatus.RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED, now)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            if request.lora_key is not None:
                running_loras.add(request.lora_key)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    eos_token_id=request.eos_token_id,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    lora_request=request.lora_request,
                    mm_features=request.mm_features,
                )
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            encoder_budget = self._allocate_encoder_inputs(request, to_encode, encoder_inputs, budget_left, encoder_budget)
            token_budget -= num_new_tokens
        # The requests skipped (for a LoRA slot, or compiling) keep their place, ahead of the rest.
        self.waiting.prepend_requests(skipped)
        for request in yielded:
            if token_budget <= 0 or len(num_scheduled_tokens) >= max_num_reqs:
                break
            scheduled, encoder_budget = self._schedule_yielded(request, token_budget, num_scheduled_tokens, cached,
                                                               spec_tokens, now, encoder_budget, encoder_inputs)
            token_budget -= scheduled
        if waiting_for_grammar and not num_scheduled_tokens:
            # Nothing else to run: wait a little for a compile rather than spin.
            futures.wait([r.structured_output_request.future for r in waiting_for_grammar],  # type: ignore[union-attr]
                         timeout=_GRAMMAR_POLL_S, return_when=futures.FIRST_COMPLETED)

        self.max_num_running_observed = max(self.max_num_running_observed, len(self.running))
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=spec_tokens,
            scheduled_encoder_inputs=encoder_inputs,
            free_encoder_mm_hashes=(self.encoder_cache_manager.get_freed_mm_hashes()
                                    if self.encoder_cache_manager is not None else []),
            kv_transfers=self.kv_cache_manager.take_kv_transfers(),
        )
        self.finished_req_ids = set()
        self.in_flight.update(num_scheduled_tokens)
        for req_id, num_tokens in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(
                output, self.requests, self.kv_cache_manager.get_block_ids)
        self._add_grammar_bitmask(output)
        self._choose_spec_lengths(output)
        return output

    def _load_offloaded(self, request: Request, hit_blocks: KVCacheBlocks, num_hit_tokens: int,
                        num_offloaded: int) -> bool:
        """Take the waiting request at the queue's front to WAITING_FOR_REMOTE_KVS: blocks for
        its ``num_offloaded`` second-tier tokens after its ``num_hit_tokens`` hit (registered
        in the prefix cache once loaded) and their loads; False, changing nothing, when too
        few blocks are free."""
        if self.kv_cache_manager.allocate_slots(request, num_offloaded, hit_blocks, delay_cache_blocks=True) is None:
            return False
        self.kv_cache_manager.load_offloaded(request, num_hit_tokens, num_offloaded)
        self.waiting.pop_request()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens + num_offloaded
        self.waiting_for_kvs[request.request_id] = request
        return True

    def _finish_loading(self, req_id: str) -> None:
        """A request's second-tier loads are done: back to the waiting queue's front (or
        freed, if it was aborted meanwhile: its blocks were kept while they were written)."""
        request = self.waiting_for_kvs.pop(req_id, None)
        if request is None:
            return
        if request.is_finished:
            self._free_request(request)
            return
        request.status = RequestStatus.WAITING
        self._kvs_loaded.add(req_id)
        self.waiting.prepend_request(request)

    def _encoder_inputs(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                        encoder_budget: int) -> tuple[list[int], int, int]:
        """``schedule_encoder_inputs`` for a request with images; (nothing, ``num_new_tokens``,
        ``encoder_budget``) for the others."""
        if not request.mm_features or self.encoder_cache_manager is None:
            return [], num_new_tokens, encoder_budget
        return schedule_encoder_inputs(self.encoder_cache_manager, request, num_computed_tokens, num_new_tokens,
                                       encoder_budget, self.config.disable_chunked_mm_input)

    def _allocate_encoder_inputs(self, request: Request, to_encode: list[int], encoder_inputs: dict[str, list[int]],
                                 budget_left: int, encoder_budget: int) -> int:
        """Enter the items ``to_encode`` of a request the step took in the encoder cache, list
        them in ``encoder_inputs``; returns the step's encoder budget left."""
        if not to_encode:
            return encoder_budget
        assert self.encoder_cache_manager is not None
        for input_id in to_encode:
            self.encoder_cache_manager.allocate(request, input_id)
        encoder_inputs[request.request_id] = to_encode
        return budget_left

    def _add_cached(self, request: Request, num_new_tokens: int, new_block_ids: tuple, cached: CachedRequestData,
                    spec_tokens: dict[str, list[int]]) -> None:
        """List a running request scheduled for ``num_new_tokens`` in this step's ``cached``
        data (its new blocks, and its tokens with pipeline parallelism) and its drafts."""
        num_known = request.num_tokens - request.num_computed_tokens
        cached.req_ids.append(request.request_id)
        cached.new_block_ids.append(new_block_ids)
        cached.num_computed_tokens.append(request.num_computed_tokens)
        if self.use_pp:
            start = request.num_computed_tokens
            cached.new_token_ids.append(request.all_token_ids[start : start + min(num_new_tokens, num_known)])
        if num_new_tokens > num_known:
            spec_tokens[request.request_id] = request.spec_token_ids[: num_new_tokens - num_known]

    def _yields_to_waiting(self, request: Request) -> bool:
        """With the priority policy: whether running ``request``, still in its prompt's
        prefill, lets the next waiting request (of a strictly higher priority) go first."""
        if self.policy != "priority" or not self.waiting:
            return False
        in_prefill = request.num_computed_tokens < request.num_prompt_tokens - 1
        return in_prefill and self.waiting.peek_request().priority < request.priority

    def _schedule_yielded(self, request: Request, token_budget: int, num_scheduled_tokens: dict[str, int],
                          cached: CachedRequestData, spec_tokens: dict[str, list[int]], now: float,
                          encoder_budget: int, encoder_inputs: dict[str, list[int]]) -> tuple[int, int]:
        """Schedule a prefill that yielded, within what the waiting requests left of the
        budget (tokens and encoder inputs) and without preempting another request; returns
        the tokens scheduled (0: none) and the encoder budget left. Without blocks for its
        chunk it is preempted itself: its blocks go to the higher-priority request it
        yielded to."""
        num_known = request.num_tokens - request.num_computed_tokens
        num_new_tokens = self.kv_cache_manager.align_to_save_point(
            request, request.num_computed_tokens, min(num_known, token_budget))
        to_encode, num_new_tokens, budget_left = self._encoder_inputs(request, request.num_computed_tokens,
                                                                      num_new_tokens, encoder_budget)
        if num_new_tokens <= 0:
            return 0, encoder_budget
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=self._lookahead(request.num_computed_tokens + num_new_tokens))
        if new_blocks is None:
            self.running.remove(request)
            self._preempt(request, now)
            return 0, encoder_budget
        self._add_cached(request, num_new_tokens, new_blocks.get_block_ids(), cached, spec_tokens)
        num_scheduled_tokens[request.request_id] = num_new_tokens
        return num_new_tokens, self._allocate_encoder_inputs(request, to_encode, encoder_inputs, budget_left,
                                                             encoder_budget)

    def _choose_spec_lengths(self, output: SchedulerOutput) -> None:
        """With adaptive speculation: each request that samples this step gets its number
        of drafts to propose after it; the step's start is noted for its cost."""
        if self.spec_length is None:
            return
        spec = output.scheduled_spec_decode_tokens
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.num_computed_tokens >= request.num_tokens + len(spec.get(req_id, ())):
                output.num_speculative_tokens[req_id] = self.spec_length.num_tokens(req_id)
        decodes_only = all(n == 1 + len(spec.get(r, ())) for r, n in output.num_scheduled_tokens.items())
        self._step_started = (time.perf_counter(), decodes_only and not self.use_pp)

    def _observe_spec_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """With adaptive speculation: time a step of decodes only (not with micro-batches
        in flight) against its draft tokens, proposed and verified."""
        started, decodes_only = self._step_started
        if self.spec_length is None or not decodes_only or runner_output.spec_token_ids is None:
            return
        num_drafts = sum(map(len, scheduler_output.scheduled_spec_decode_tokens.values()))
        num_drafts += sum(map(len, runner_output.spec_token_ids))
        self.spec_length.observe_step(time.perf_counter() - started, len(scheduler_output.num_scheduled_tokens),
                                      num_drafts)

    def _preemption_victim(self, req_index: int) -> Request:
        """Take out of ``running`` the newest request at ``req_index`` or after it (the
        request being scheduled, or one not yet scheduled this step) that is not in flight:
        freeing the blocks of an in-flight request would lose the output its step brings."""
        for index in range(len(self.running) - 1, req_index - 1, -1):
            if self.running[index].request_id not in self.in_flight:
                return self.running.pop(index)
        raise AssertionError("the request being scheduled is never in flight")

    def has_schedulable_requests(self) -> bool:
        """Whether a request waits, or runs without being in flight (another step may
        include it now)."""
        return bool(self.waiting or self.waiting_for_kvs) or any(r.request_id not in self.in_flight for r in self.running)

    def _lora_fits(self, lora_key: tuple[str, int, int], running_loras: set) -> bool:
        """Whether a request of adapter ``lora_key`` may start next to ``running_loras``."""
        return self.max_loras is None or lora_key in running_loras or len(running_loras) < self.max_loras

    def _lookahead(self, num_tokens_after: int) -> int:
        """Lookahead slots to reserve past a request's first ``num_tokens_after`` tokens
        (computed + scheduled): the draft model's, never past ``max_model_len``."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_tokens_after))

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a WAITING_FOR_GRAMMAR request's grammar is compiled (it becomes WAITING);
        a failed compile finishes it (aborted, reported by the next ``update_from_output``)."""
        assert request.structured_output_request is not None
        try:
            if not request.structured_output_request.is_ready():
                return False
        except ValueError as exc:
            logger.error("Request %s: its structured outputs constraint failed to compile: %s",
                         request.request_id, exc)
            request.status = RequestStatus.FINISHED_ABORTED
            self._failed_grammar.append(request)
            return False
        request.status = RequestStatus.WAITING
        return True

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Bitmask rows for each constrained request that samples this step (its known
        tokens are all computed after it: not in the middle of its prompt): one for its
        next token and one after each of its draft tokens."""
        if not self._num_constrained:
            return
        grammars, drafts = [], []
        num_rows = 0
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            so_request = request.structured_output_request
            spec = output.scheduled_spec_decode_tokens.get(req_id, [])
            if (
                so_request is not None and request.num_computed_tokens == request.num_tokens + len(spec)
                and self._constrains_next(request)
            ):  # fmt: skip
                output.structured_output_request_ids[req_id] = num_rows
                grammars.append(so_request.grammar)
                drafts.append(spec)
                num_rows += 1 + len(spec)
        if grammars:
            assert self.structured_output_manager is not None
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(grammars, drafts)

    def _preempt(self, request: Request, now: float) -> None:
        self.kv_cache_manager.free(request)
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.free(request)
        request.spec_token_ids = []
        request.record_event(EngineCoreEventType.PREEMPTED, now)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.finished_req_ids.add(request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, apply the engine's stop rules, free finished requests.

        The engine stops on EOS (unless ``ignore_eos``), ``stop_token_ids``, ``max_tokens``
        and ``max_model_len``; stop strings are the front end's job. A request may bring
        several tokens in one step (speculative decoding): they are taken in order up to the
        first that stops it, and the rest (with their logprobs) are dropped.
        """
        self._observe_spec_step(scheduler_output, runner_output)
        spec_stats = SpecDecodingStats.new(self.num_spec_tokens) if self.num_spec_tokens else None
        outputs = [self._failed_grammar_output(request) for request in self._failed_grammar]
        self._failed_grammar = []
        for req_id in runner_output.finished_recving:
            self._finish_loading(req_id)
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.mm_features and self.encoder_cache_manager is not None:
                free_computed_encoder_inputs(self.encoder_cache_manager, request)
            if req_id in runner_output.failed_req_ids:
                outputs.append(self._abort_failed(request, runner_output.failed_req_ids[req_id]))
                continue
            if req_id in runner_output.pooler_output:
                outputs.append(self._finish_pooled(request, runner_output.pooler_output[req_id]))
                continue
            index = runner_output.req_id_to_index[req_id]
            new_token_ids = runner_output.sampled_token_ids[index]
            prompt_logprobs = self._unsent_prompt_logprobs(request, runner_output.prompt_logprobs_dict.get(req_id))
            if not new_token_ids and prompt_logprobs is None:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                self._roll_back_rejected(request, len(drafts), len(new_token_ids) - 1, spec_stats)
                if self.spec_length is not None:
                    self.spec_length.observe(req_id, len(drafts), len(new_token_ids) - 1)
            new_token_ids = self._append_until_stop(request, new_token_ids)
            if runner_output.spec_token_ids is not None and not request.is_finished:
                request.spec_token_ids = self._usable_drafts(request, runner_output.spec_token_ids[index])
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=(runner_output.logprobs_for(index, len(new_token_ids))
                                  if new_token_ids else None),
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    events=request.take_events(),
                    kv_transfer_params=(self.kv_connector.request_finished(request)
                                        if self.kv_connector is not None and request.is_finished else None),
                )
            )
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(spec_stats), timestamp=time.time())

    @staticmethod
    def _roll_back_rejected(request: Request, num_drafts: int, num_accepted: int,
                            spec_stats: Optional[SpecDecodingStats]) -> None:
        """Un-count the rejected drafts' positions (their KV is overwritten by a later step)
        and record the verification."""
        request.num_computed_tokens -= num_drafts - num_accepted
        request.spec_token_ids = []
        if spec_stats is not None:
            spec_stats.observe_draft(num_drafts, num_accepted)

    def _usable_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """``drafts`` cut so that verifying them cannot pass ``max_tokens`` or
        ``max_model_len`` (the token sampled after the last draft counts too), and, for a
        request with a structured outputs constraint, before the first its grammar refuses
        (``validate_tokens``, as vLLM): the target then samples every position under the
        grammar (``_add_grammar_bitmask``)."""
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        drafts = drafts[: max(room, 0)]
        so_request = request.structured_output_request
        if so_request is None or not drafts or not self._constrains_next(request):
            return drafts
        return so_request.grammar.validate_tokens(drafts)  # type: ignore[union-attr]

    def _finish_pooled(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """Finish a pooling model's request whose prompt is computed: its only output carries
        the pooled vector (it generates no token)."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        self._free_request(request)
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.STOP,
                                num_cached_tokens=max(request.num_cached_tokens, 0), events=request.take_events(),
                                pooling_output=pooled)

    def _abort_failed(self, request: Request, reason: str) -> EngineCoreOutput:
        """Abort a running request the runner could not serve (logged with ``reason``)."""
        logger.error("Request %s aborted: %s", request.request_id, reason)
        kv_params = self.kv_connector.request_failed(request, reason) if self.kv_connector is not None else None
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                                events=request.take_events(), kv_transfer_params=kv_params)

    def _failed_grammar_output(self, request: Request) -> EngineCoreOutput:
        """The final (aborted) output of a request whose grammar failed to compile."""
        self._free_request(request)
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                finish_reason=request.get_finished_reason(), events=request.take_events())

    @staticmethod
    def _unsent_prompt_logprobs(
        request: Request, chunk: Optional[tuple[int, LogprobsLists]]
    ) -> Optional[LogprobsLists]:
        """The part of a chunk's prompt logprobs not sent before (a preempted request
        recomputes its prompt, and the front end must see each position once)."""
        if chunk is None:
            return None
        first, lists = chunk
        skip = max(0, request.num_prompt_logprobs_sent - first)
        if skip >= len(lists.ranks):
            return None
        request.num_prompt_logprobs_sent = first + len(lists.ranks)
        if skip == 0:
            return lists
        return LogprobsLists(lists.token_ids[skip:], lists.logprobs[skip:], lists.ranks[skip:])

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append ``token_ids`` to the request one by one, up to the first that finishes it.

        Returns:
            the appended tokens: ``token_ids`` itself, or its prefix ending at the stopping
            token.
        """
        so_request = request.structured_output_request
        for i, token_id in enumerate(token_ids):
            request.append_output_token_id(token_id)
            if (
                so_request is not None and self._advances_grammar(request)
                and not so_request.grammar.accept_tokens([token_id])  # type: ignore[union-attr]
            ):  # fmt: skip
                logger.error("Request %s: token %d is not allowed by its grammar.", request.request_id, token_id)
            if self._check_stop(request, token_id):
                return token_ids if i + 1 == len(token_ids) else token_ids[: i + 1]
        return token_ids

    def _constrains_next(self, request: Request) -> bool:
        """Whether a constrained request's grammar applies to its next token (with a reasoning
        parser: once the reasoning has ended; ``StructuredOutputManager.should_fill_bitmask``)."""
        assert self.structured_output_manager is not None and request.structured_output_request is not None
        return self.structured_output_manager.should_fill_bitmask(
            request.structured_output_request, request.prompt_token_ids
        )

    def _advances_grammar(self, request: Request) -> bool:
        """Whether a constrained request's grammar takes its newest output token
        (``StructuredOutputManager.should_advance``)."""
        assert self.structured_output_manager is not None and request.structured_output_request is not None
        return self.structured_output_manager.should_advance(
            request.structured_output_request, request.prompt_token_ids, request.output_token_ids
        )

    def _check_stop(self, request: Request, last: int) -> bool:
        """Finish the request if ``last``, its newest output token, stops it; True if so."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:  # type: ignore[operator]
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        so_request = request.structured_output_request
        if (so_request is not None and so_request.grammar.is_terminated()  # type: ignore[union-attr]
                and (last == request.eos_token_id or last in params.stop_token_ids)):  # type: ignore[operator]
            # The grammar ended on its stop token (despite ignore_eos or min_tokens): it
            # allows nothing more. NOTE: a grammar that can only end (llguidance stops
            # there) allows only stop tokens next, so the request ends on one, whose text
            # the front end leaves out.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.status = status  # freed when its loads are done (``_finish_loading``)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        """Release a finished request that the caller has taken out of its queue."""
        self.kv_cache_manager.free(request)
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self._kvs_loaded.discard(request.request_id)
        if self.spec_length is not None:
            self.spec_length.remove(request.request_id)
        if request.structured_output_request is not None:
            self._num_constrained -= 1
        if self.kv_connector is not None:
            self.kv_connector.request_freed(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_for_kvs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.waiting_for_kvs)

    def make_stats(self, spec_decoding_stats: Optional[SpecDecodingStats] = None) -> SchedulerStats:
        """Gauges, and counters since the previous call (prefix-cache tokens, preemptions),
        with the step's ``spec_decoding_stats`` when given."""
        kv = self.kv_cache_manager
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            external_prefix_cache_queries=kv.external_prefix_cache_queries,
            external_prefix_cache_hits=kv.external_prefix_cache_hits,
            num_preemptions=self.num_preemptions - self._num_preemptions_reported,
            spec_decoding_stats=spec_decoding_stats,
        )
        if self.max_loras is not None:
            stats.running_lora_adapters = sorted({r.lora_request.lora_name for r in self.running if r.lora_request})
            stats.waiting_lora_adapters = sorted({r.lora_request.lora_name for r in self.waiting if r.lora_request})
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0
        kv.external_prefix_cache_queries = kv.external_prefix_cache_hits = 0
        self._num_preemptions_reported = self.num_preemptions
        return stats

    def get_request(self, request_id: str) -> Optional[Request]:
        return self.requests.get(request_id)
