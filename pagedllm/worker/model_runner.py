"""Turns a ``SchedulerOutput`` into tensors, runs the model once over every scheduled
token, and samples.

One forward per step: decode requests (one query token each) first, then prefill chunks;
inputs are built from the persistent ``InputBatch`` with numpy indexing.
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import prepare_kernels
from pagedllm.attention.metadata import AttentionMetadata, set_forward_context
from pagedllm.config import EngineConfig
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.messages.engine_core import LogprobsLists
from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.layers.sampler import Sampler, compute_logprobs_with_topk
from pagedllm.model_executor.model_loader import get_model
from pagedllm.platforms import current_platform
from pagedllm.worker.cpu_malloc import tune_malloc
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.kv_cache_sizing import kv_bytes_per_token
from pagedllm.messages.runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

logger = logging.getLogger(__name__)

#: Tokens in the CPU profiling run; the measured activation peak is scaled linearly to
#: ``max_num_batched_tokens`` (activations grow linearly with tokens per step). 64, not more:
#: the run is compute-bound, and on a 2-core AVX2 CPU 256 tokens of the 0.5B shape took 1.8 s
#: of start-up (the peak measured with 64, 128 and 256 tokens: 760, 810 and 587 MB).
_CPU_PROFILE_TOKENS = 64


class ModelRunner:
    """Owns the model, the KV caches and the persistent batch on one device.

    Its ``Worker`` sets it up in steps: ``load_model``, ``profile_run`` (when the KV cache
    is sized from the memory left), ``initialize_kv_cache``; then ``execute_model`` runs
    each step.

    Args:
        config: the engine configuration.
        device: the device the model runs on.
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.scheduler_config = config.scheduler_config
        self.device = device
        self.block_size = self.cache_config.block_size

    def load_model(self) -> None:
        """Load the weights; ``weights_bytes`` counts parameters and buffers (bytes)."""
        start = time.perf_counter()
        self.model = get_model(self.model_config, self.device)
        # Buffers too: the packed copy of tied output embeddings, rotary tables.
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self.weights_bytes = sum(t.numel() * t.element_size() for t in tensors)
        logger.info("Loaded %s (%.1f MB) in %.2f s", self.model_config.model_path,
                    self.weights_bytes / 1e6, time.perf_counter() - start)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        #: Prefill tokens are attended as decode queries by the CPU kernel (see backend).
        self.prefill_as_decode = prepare_kernels(self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks per layer and the persistent batch."""
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.input_batch = InputBatch(
            self.scheduler_config.max_num_seqs, self.model_config.max_model_len, self.block_size, self.device
        )
        self.sampler = Sampler()
        if self.device.type == "cpu":
            # From now on step buffers stay in the heap (see cpu_malloc); not before: the
            # weights and the KV cache, allocated once, load faster as mappings of their own.
            tune_malloc()

    # ------------------------------------------------------------------ set-up
    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer.

        NOTE: allocated uninitialised (memory is committed only as blocks are used) and never
        cleared: no attention path lets a slot past a request's context reach its output
        (the CPU kernel does not read them; the portable one zeroes what it gathered there).
        """
        caches = []
        for layer in self.attention_layers:
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            cache = torch.empty(shape, dtype=self.model_config.dtype, device=self.device)
            layer.kv_cache = cache
            caches.append(cache)
        return caches

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Peak activation memory (bytes) of a forward over ``max_num_batched_tokens`` tokens.

        CUDA: measured with ``torch.cuda.max_memory_allocated`` over a full-size dummy run.
        CPU: the growth of the process's peak RSS over a ``_CPU_PROFILE_TOKENS``-token dummy
        run, scaled linearly (a full-size run would dominate start-up time on CPU).
        """
        max_tokens = self.scheduler_config.max_num_batched_tokens
        if current_platform.is_cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            self._dummy_run(max_tokens)
            return torch.cuda.max_memory_allocated() - base
        num_tokens = min(max_tokens, _CPU_PROFILE_TOKENS)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._dummy_run(num_tokens)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return int(max(after - before, 0) * max_tokens / num_tokens)

    def _dummy_run(self, num_tokens: int) -> None:
        """Forward ``num_tokens`` tokens as prefills of at most ``max_model_len`` tokens each,
        with a temporary KV cache just large enough."""
        seq_len = min(num_tokens, self.model_config.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        num_blocks = num_seqs * blocks_per_seq
        for layer in self.attention_layers:
            layer.kv_cache = torch.zeros(
                (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim),
                dtype=self.model_config.dtype, device=self.device,
            )
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        slots = torch.cat([torch.arange(n) + i * blocks_per_seq * self.block_size for i, n in enumerate(lens)])
        metadata = AttentionMetadata(
            slot_mapping=slots.to(self.device),
            num_decodes=0,
            decode_block_table=torch.zeros((0, 1), dtype=torch.int64, device=self.device),
            decode_seq_lens=torch.zeros(0, dtype=torch.int64, device=self.device),
            prefill_query_start_loc=[0, *np.cumsum(lens).tolist()],
            prefill_seq_lens=lens,
            prefill_block_table=torch.arange(num_blocks, device=self.device).view(num_seqs, blocks_per_seq),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with set_forward_context(metadata):
            hidden = self.model(input_ids, positions)
        self.model.compute_logits(hidden[: self.scheduler_config.max_num_seqs])
        for layer in self.attention_layers:
            layer.kv_cache = torch.empty(0)

    # ------------------------------------------------------------------ steps
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = batch.requests[req_id]
            batch.append_block_ids(state.row, block_ids)
            batch.num_computed_tokens[state.row] = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update the persistent batch, forward all scheduled tokens, sample.

        Returns:
            the sampled token ids (and logprobs) of requests whose known tokens are now all
            computed; requests in the middle of their prompt sample nothing.
        """
        self._update_states(so)
        if so.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        decodes = [r for r, n in so.num_scheduled_tokens.items() if n == 1]
        prefills = [r for r, n in so.num_scheduled_tokens.items() if n > 1]
        order = decodes + prefills
        states = [batch.requests[r] for r in order]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in order), dtype=np.int64, count=len(order))
        computed = batch.num_computed_tokens[rows]
        cu = np.cumsum(num_sched)
        starts = cu - num_sched
        token_req = np.repeat(np.arange(len(order)), num_sched)
        positions = computed[token_req] + np.arange(cu[-1]) - starts[token_req]
        token_rows = rows[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.block_size
        slot_mapping = batch.block_table[token_rows, positions // bs] * bs + positions % bs
        seq_lens = computed + num_sched
        metadata = self._attention_metadata(rows, seq_lens, num_sched, len(decodes), slot_mapping, token_rows, positions)

        with set_forward_context(metadata):
            hidden = self.model(self._to_device(input_ids), self._to_device(positions))

        batch.num_computed_tokens[rows] = seq_lens
        prompt_logprobs = self._prompt_logprobs(hidden, states, computed, seq_lens, starts)
        logits_indices, sample_reqs = self._logits_indices(rows, seq_lens, cu)
        sample_rows = rows[sample_reqs]
        num_output_tokens = np.maximum(positions[logits_indices] + 1 - batch.num_prompt_tokens[sample_rows], 0)
        tokens, logprobs = self._sample(hidden, logits_indices, sample_rows, num_output_tokens)
        sampled_token_ids: list[list[int]] = [[] for _ in order]
        logprobs_index: dict[int, int] = {}
        for j, (i, token) in enumerate(zip(sample_reqs.tolist(), tokens)):
            state = states[i]
            if not sampled_token_ids[i] and state.sampling_params.logprobs is not None:
                logprobs_index[i] = j
            sampled_token_ids[i].append(token)
            batch.append_token(state, token)
        return ModelRunnerOutput(
            req_ids=order,
            req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            logprobs_index=logprobs_index,
            prompt_logprobs_dict=prompt_logprobs,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _attention_metadata(
        self,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        num_sched: np.ndarray,
        num_decodes: int,
        slot_mapping: np.ndarray,
        token_rows: np.ndarray,
        positions: np.ndarray,
    ) -> AttentionMetadata:
        """The step's metadata; ``rows`` / ``seq_lens`` / ``num_sched`` per request (decodes
        first), ``slot_mapping`` / ``token_rows`` / ``positions`` per token."""
        bs = self.block_size
        table = self.input_batch.block_table

        def block_table_for(part_rows: np.ndarray, part_lens: np.ndarray) -> torch.Tensor:
            width = int(-(-part_lens.max() // bs)) if len(part_lens) else 1
            return self._to_device(np.ascontiguousarray(table[part_rows, :width]))

        prefill_lens = seq_lens[num_decodes:]
        per_token: dict[str, torch.Tensor] = {}
        if self.prefill_as_decode and len(prefill_lens):
            # Token t of a prefill is a decode query: its request's table, t's position + 1.
            # (The first num_decodes tokens are the decodes', one each.)
            per_token = {
                "prefill_token_block_table": block_table_for(token_rows[num_decodes:], prefill_lens),
                "prefill_token_seq_lens": self._to_device(positions[num_decodes:] + 1),
            }
        return AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            num_decodes=num_decodes,
            decode_block_table=block_table_for(rows[:num_decodes], seq_lens[:num_decodes]),
            decode_seq_lens=self._to_device(seq_lens[:num_decodes]),
            prefill_query_start_loc=[0, *np.cumsum(num_sched[num_decodes:]).tolist()],
            prefill_seq_lens=prefill_lens.tolist(),
            prefill_block_table=block_table_for(rows[num_decodes:], prefill_lens),
            **per_token,
        )

    def _logits_indices(
        self, rows: np.ndarray, seq_lens: np.ndarray, cu: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The flattened-token positions whose logits are sampled this step, and for each the
        index of its request in the step's order (non-decreasing; a request may have several
        consecutive positions, e.g. draft tokens to verify).

        One position per request whose known tokens are now all computed: its last one.
        """
        sample_reqs = np.flatnonzero(seq_lens == self.input_batch.num_tokens[rows])
        return cu[sample_reqs] - 1, sample_reqs

    def _sample(
        self, hidden: torch.Tensor, logits_indices: np.ndarray, sample_rows: np.ndarray,
        num_output_tokens: np.ndarray,
    ) -> tuple[list[int], Optional[LogprobsLists]]:
        """Sample one token at each of ``logits_indices`` (flattened-token positions of
        ``hidden``), for the batch rows ``sample_rows`` that have ``num_output_tokens``
        output tokens before it; returns the tokens and, when asked for, their logprobs."""
        if len(logits_indices) == 0:
            return [], None
        logits = self.model.compute_logits(hidden[self._to_device(logits_indices)])
        metadata = self.input_batch.sampling_metadata(sample_rows, num_output_tokens, logits.shape[-1])
        out = self.sampler(logits, metadata)
        tokens = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return tokens, None
        return tokens, LogprobsLists(
            token_ids=out.logprob_token_ids.tolist(),  # type: ignore[union-attr]
            logprobs=out.logprobs.tolist(),
            ranks=out.ranks.tolist(),  # type: ignore[union-attr]
        )

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        computed: np.ndarray,
        seq_lens: np.ndarray,
        starts: np.ndarray,
    ) -> dict[str, tuple[int, LogprobsLists]]:
        """Logprobs of the prompt tokens predicted by this step's chunk of each request that
        asked for them: position p's logits score prompt token p + 1."""
        result: dict[str, tuple[int, LogprobsLists]] = {}
        for i, state in enumerate(states):
            k = state.sampling_params.prompt_logprobs
            first, end = int(computed[i]), min(int(seq_lens[i]), state.num_prompt_tokens - 1)
            if k is None or first >= end:
                continue
            idx = torch.arange(end - first, device=self.device) + int(starts[i])
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            targets = self._to_device(self.input_batch.token_ids[state.row, first + 1 : end + 1].copy())
            ids, values, ranks = compute_logprobs_with_topk(logprobs, targets, k)
            result[state.req_id] = (first + 1, LogprobsLists(ids.tolist(), values.tolist(), ranks.tolist()))
        return result

    def kv_cache_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config)
