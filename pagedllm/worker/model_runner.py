"""Turns a ``SchedulerOutput`` into tensors, runs the model once over every scheduled
token, and samples (a pooling model's runner pools instead: ``_pool``).

One forward per step: decode requests (one query token each) first, then prefill chunks
and requests verifying draft tokens; inputs are built from the persistent ``InputBatch``
with numpy indexing. With speculative decoding (``pagedllm.spec_decode``) the runner
samples the target at a request's last known token and at each of its drafts, keeps the
drafts the rejection sampler accepts plus one token, and asks the proposer for the next
drafts, returned in ``ModelRunnerOutput.spec_token_ids``.

With pipeline parallelism each stage's runner gets the same ``SchedulerOutput``; a stage
after the first receives the previous stage's hidden states and residual instead of
embedding the tokens, a stage before the last sends its own on (``GroupCoordinator``
send / recv over the pipeline group, the sends not waited for: the stage goes on to its
next step); the last stage samples, and the earlier stages learn each request's tokens
from the next ``SchedulerOutput`` that schedules it (``CachedRequestData.new_token_ids``),
so no stage waits for the last one and several steps (micro-batches) can be in flight
(``pagedllm.engine.batch_queue``).

An image-text model (one with ``get_multimodal_embeddings``): before the forward, the runner
runs the vision encoder on the step's ``scheduled_encoder_inputs`` and keeps each image's
embeddings in its encoder cache (by content hash, until ``free_encoder_mm_hashes`` drops
them); the step's token embeddings then get, at each scheduled placeholder position that takes
one (``PlaceholderRange.embeds_in``: all of them, or those its ``is_embed`` flags), the next row
of its image's embeddings, and the model runs on ``inputs_embeds`` (``_multimodal_embeds``).

A model with multimodal RoPE (one with ``get_mrope_input_positions``: Qwen2.5-VL, Qwen3-VL)
takes three position rows (t, h, w) per token: the model computes a request's prompt rows once,
when the request is added, from its prompt and images (``_mrope_positions``); a token past the
prompt is at its index plus the request's ``mrope_position_delta`` on every row
(``_model_positions``). The slot mapping and attention metadata use the plain token index.

A model of ``BIDIRECTIONAL_IMAGE_ARCHITECTURES`` (Gemma 3) attends both ways inside each
image's tokens: the step's attention metadata carries the scheduled images' placeholder ranges
as ``bidirectional_ranges`` (``_bidirectional_ranges``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import numpy as np
import torch

from pagedllm.arch_config import BIDIRECTIONAL_IMAGE_ARCHITECTURES
from pagedllm.attention.backends.abstract import AttentionMetadata, CommonAttentionMetadata
from pagedllm.attention.metadata import set_forward_context
from pagedllm.attention.selector import get_attn_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed import get_pp_group, get_tp_group
from pagedllm.distributed.kv_transfer.kv_blocks import KVBlockLayout, block_dim
from pagedllm.distributed.kv_transfer.offloading import OffloadingWorker, make_block_store
from pagedllm.distributed.kv_transfer.base import KVConnectorWorker
from pagedllm.distributed.kv_transfer.factory import make_worker_connector
from pagedllm.distributed.kv_transfer.layout import KVLayout
from pagedllm.messages.sched_output import SchedulerOutput
from pagedllm.messages.engine_core import LogprobsLists
from pagedllm.model_executor.layers.attention import Attention, bind_kv_caches, init_kv_scales
from pagedllm.model_executor.layers.fused_moe.layer import FusedMoE, run_idle_exchanges
from pagedllm.model_executor.layers.mamba.abstract import (
    MambaBase,
    bind_state_caches,
    build_mamba_metadata,
    zero_fresh_states,
)
from pagedllm.model_executor.layers.pooler import Pooler, PoolingState
from pagedllm.model_executor.layers.sampler import Sampler, compute_logprobs_with_topk
from pagedllm.model_executor.model_loader import get_model
from pagedllm.model_executor.sampling_metadata import SamplingMetadata
from pagedllm.platforms import current_platform
from pagedllm.spec_decode import DraftModelProposer, EagleProposer, NgramProposer
from pagedllm.spec_decode.draft_model import TargetStep
from pagedllm.spec_decode.rejection_sampler import num_accepted_matching, rejection_sample
from pagedllm.worker import sleep_mode
from pagedllm.worker.grammar_bitmask import sampled_rows_bitmask
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.kv_cache_sizing import kv_bytes_per_block, kv_cache_groups, num_state_slots, stage_layer_range
from pagedllm.messages.runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

logger = logging.getLogger(__name__)



class ModelRunner:
    """Owns the model, the KV caches and the persistent batch on one device.

    KV-cache groups (``kv_cache_groups``; one for a model with one kind of attention): each
    request has a block table per group, each step a slot mapping and an attention metadata
    per group, and each attention layer reads its group's (``Attention.kv_cache_group_id``).
    A drafter with its own KV cache uses group 0 (full attention, whenever there is one).

    State layers (``MambaBase``: Mamba-2 mixers ...) form state groups after the attention
    groups: each layer gets zeroed state tensors of ``num_state_slots`` slots, each request
    a working slot per state group (column 0 of its "block table" there), and each step a
    ``MambaMetadata`` per state group in the forward context, after the attention groups'
    metadata. With prefix caching a new request's table may name a hit's slot after it (its
    state is copied into the working slot before the step), and a step's new entry names a
    save slot (the working slot is copied into it after the step): ``MambaManager``.

    With a second KV tier (``--kv-offloading-size``) an ``OffloadingWorker`` applies each
    step's ``kv_transfers`` (stores snapshotted before the forward, the rest on its thread)
    and the step's output names the requests whose loads are written (``finished_recving``).

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
        self.kv_cache_groups = kv_cache_groups(config)
        #: The KV cache's element type: the model's dtype, or FP8 (``--kv-cache-dtype``).
        self.kv_cache_dtype = self.cache_config.kv_cache_dtype(self.model_config.dtype)
        self.pp = get_pp_group()
        self.lora_manager = None  # a LoRAModelManager with --enable-lora (load_model)
        self.proposer = self._make_proposer()
        # Request id -> [k, V] distributions its pending drafts were sampled from.
        self._draft_probs: dict[str, torch.Tensor] = {}
        #: A pooling model's pooler (``--runner pooling``; None: the runner samples), and the
        #: pooling so far of each request whose prompt is part-computed.
        pooler_config = self.model_config.pooler_config
        self.pooler = None if pooler_config is None else Pooler(pooler_config.pooling_type)
        self._pooling_states: dict[str, PoolingState] = {}
        #: Image-text models: content hash -> an image's embeddings [placeholders, hidden], and
        #: each request's images (``MultiModalFeatureSpec``).
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self._mm_features: dict[str, list] = {}
        self.kv_offload: Optional[OffloadingWorker] = None
        #: The worker side of a KV connector (a prefill / decode split; None: no split),
        #: made with the KV cache (``initialize_kv_cache``).
        self.kv_connector: Optional[KVConnectorWorker] = None
        #: Multimodal-RoPE models: request id -> (its prompt's positions [3, P] int64, its
        #: ``mrope_position_delta``).
        self._mrope_positions: dict[str, tuple[np.ndarray, int]] = {}
        #: Whether each image's tokens attend to each other both ways.
        self.bidirectional_images = self.model_config.architecture in BIDIRECTIONAL_IMAGE_ARCHITECTURES

    def _make_proposer(self) -> DraftModelProposer | NgramProposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.is_eagle:
            return EagleProposer(spec, self.block_size, self.device, self.scheduler_config.max_num_batched_tokens)
        if spec.uses_draft_model:
            return DraftModelProposer(spec, self.block_size, self.device,
                                      self.scheduler_config.max_num_batched_tokens)
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def load_model(self) -> None:
        """Choose the attention backend (once; it builds the CPU kernels now if it is
        CPU_ATTN), then load the weights; ``weights_bytes`` counts parameters and buffers
        (bytes).

        Raises:
            ValueError: no attention backend can run, or the named one is unknown or cannot
                run here (see ``pagedllm.attention.selector.get_attn_backend``).
        """
        self.attn_backend = get_attn_backend(
            self.model_config.head_dim, self.model_config.dtype, self.block_size, self.config.attention_config.backend,
            kv_cache_dtype=self.cache_config.cache_dtype,
            uses_sliding_window=self.model_config.sliding_window is not None, use_mla=self.model_config.use_mla,
            uses_bidirectional_ranges=self.bidirectional_images,
            uses_chunked_local_attention=self.model_config.attention_chunk_size is not None,
        )
        logger.info("Attention backend: %s", self.attn_backend.get_name())
        self.attn_metadata_builder = self.attn_backend.get_builder_cls()(
            self.block_size, self.device, batch_invariant=self.model_config.batch_invariant
        )
        start = time.perf_counter()
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        #: Whether the model takes three position rows per token (multimodal RoPE).
        self.uses_mrope = hasattr(self.model, "get_mrope_input_positions")
        if self.pooler is not None:  # a classifier's head on each pooled state (None: an embedder)
            self.pooler.head = getattr(self.model, "pooler_head", None)
        # Buffers too: the layers' float32 weight copies, rotary tables; and LoRA slots.
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self.weights_bytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.config.lora_config is not None:
            self.lora_manager = self._make_lora_manager()
            self.weights_bytes += self.lora_manager.nbytes
        logger.info("Loaded %s (%.1f MB) in %.2f s", self.model_config.model_path,
                    self.weights_bytes / 1e6, time.perf_counter() - start)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.state_layers = [m for m in self.model.modules() if isinstance(m, MambaBase)]
        spread = [m for m in self.model.modules() if isinstance(m, FusedMoE) and m.dp_group is not None]
        if spread:
            logger.info("Experts spread over %d data-parallel engines: engine %d holds experts %d-%d of %d in each of "
                        "%d MoE layers.", spread[0].dp_group.world_size, spread[0].dp_group.rank_in_group,
                        spread[0].expert_start, spread[0].expert_start + spread[0].local_num_experts - 1,
                        spread[0].global_num_experts, len(spread))
        self._layer_groups = self._attention_layer_groups()
        self._state_layer_groups = self._state_groups_of_layers()
        init_kv_scales(self.attention_layers, self.cache_config.cache_dtype, self.cache_config.calculate_kv_scales)
        if isinstance(self.proposer, EagleProposer):
            self.proposer.load_model(self.attn_backend, self.attn_metadata_builder, self.model)
        elif isinstance(self.proposer, DraftModelProposer):
            self.proposer.load_model(self.attn_backend, self.attn_metadata_builder)
        if isinstance(self.proposer, DraftModelProposer):
            self.weights_bytes += self.proposer.weights_bytes

    def _attention_layer_groups(self) -> list[tuple[int, int]]:
        """Per attention layer of this stage (one per decoder layer with a KV cache, a hybrid
        layer's beside its state, in order): its KV-cache group, and its cache tensor (the j-th of the stage's
        layers in its group uses tensor j: ``kv_cache_sizing.num_stage_cache_tensors`` of them).

        Raises:
            ValueError: a model whose attention layers are not one per such decoder layer.
        """
        if self.model_config.is_encoder and not self.attention_layers:
            return []  # an encoder attends within each whole prompt: it has no KV cache
        start, end = stage_layer_range(self.model_config)
        group_of = self.kv_cache_groups.group_of_layer()
        layers = [i for i in range(start, end) if i in group_of]
        if len(self.attention_layers) != len(layers):
            raise ValueError(f"{len(self.attention_layers)} attention layers for the {len(layers)} attention layers "
                             f"of decoder layers {start} .. {end - 1}: KV-cache groups need one attention layer per "
                             "decoder layer with a KV cache.")
        num_in_group: dict[int, int] = {}
        layer_groups = []
        for layer in layers:
            group = group_of[layer][0]
            layer_groups.append((group, num_in_group.get(group, 0)))
            num_in_group[group] = num_in_group.get(group, 0) + 1
        return layer_groups

    def _state_groups_of_layers(self) -> list[int]:
        """Per state layer of this stage (``MambaBase``, in order): its state group's index
        among all groups (``KVCacheGroups.state_group_of_layer``).

        Raises:
            ValueError: state layers that are not one per state decoder layer.
        """
        start, end = stage_layer_range(self.model_config)
        group_of = self.kv_cache_groups.state_group_of_layer()
        layers = [i for i in range(start, end) if i in group_of]
        if len(self.state_layers) != len(layers):
            raise ValueError(f"{len(self.state_layers)} state layers for the {len(layers)} state layers of decoder "
                             f"layers {start} .. {end - 1} (pagedllm.arch_config.state_layer_indices).")
        return [group_of[i] for i in layers]

    def _make_lora_manager(self):
        """Wrap the model's linear layers for multi-LoRA (``pagedllm.lora``)."""
        from pagedllm.lora.model_manager import LoRAModelManager

        lora = self.config.lora_config
        return LoRAModelManager(
            self.model, self.model_config.hf_config, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, self.device,
            self.model_config.dtype,
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks per layer (the draft model's too, in its
        model's dtype) and the persistent batch; with ``calculate_kv_scales``, the next
        forward (the first batch) sets each layer's FP8 scales."""
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        if self.config.kv_transfer_config is not None:
            if self.kv_connector is None:
                self.kv_connector = make_worker_connector(self.config.kv_transfer_config)
            layout = KVLayout.of(self.kv_caches, self.block_size, self.model_config.architecture,
                                 get_tp_group().world_size, self.pp.world_size)
            self.kv_connector.register_kv_caches(self.kv_caches, layout)
        self.num_state_slots = num_state_slots(self.config, self.kv_cache_groups)
        self.state_caches = bind_state_caches(self.state_layers, self._state_layer_groups, self.num_state_slots,
                                              self.device)
        if self.cache_config.calculate_kv_scales and self.cache_config.cache_dtype != "auto":
            for layer in self.attention_layers:  # from the first batch: the profiling run is over
                layer.calculate_kv_scales = True
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.initialize_kv_cache(num_blocks)
        self.input_batch = InputBatch(
            self.scheduler_config.max_num_seqs, self.model_config.max_model_len, self.block_size, self.device,
            self.kv_cache_groups.num_groups,
        )
        self.sampler = Sampler()
        self._start_kv_offload()
        current_platform.prepare_for_steps()

    def _start_kv_offload(self) -> None:
        """The second KV tier's worker over the caches just allocated (the previous one, after
        a wake-up, stopped), in host RAM or files under ``kv_offloading_path``."""
        if self.kv_offload is not None:
            self.kv_offload.close()
        if self.cache_config.kv_offloading_size is None:
            return
        dims = []
        for cache in self.kv_caches:
            layer = next(a for a in self.attention_layers if a.kv_cache is cache)
            dims.append(block_dim(lambda n, layer=layer: layer.attn_backend.get_kv_cache_shape(
                n, self.block_size, layer.num_kv_heads, layer.head_dim)))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.kv_offload = OffloadingWorker(KVBlockLayout(self.kv_caches, dims),
                                           make_block_store(self.cache_config.kv_offloading_path, rank))

    # ------------------------------------------------------------------ sleep mode
    def _models(self) -> list[torch.nn.Module]:
        """The model, and the drafter's when it has its own."""
        draft = getattr(self.proposer, "model", None)
        return [self.model] if draft is None or draft is self.model else [self.model, draft]

    def sleep(self, level: int) -> None:
        """Free the KV caches and take the weights out of memory (``sleep_mode``): level 1
        into a file, level 2 dropped (``wake_up`` loads the checkpoint again).

        Raises:
            ValueError: level 2 with LoRA or a draft model (the checkpoint alone cannot refill them).
        """
        if level == 2 and (self.lora_manager is not None or len(self._models()) > 1):
            raise ValueError("Sleep level 2 reloads the checkpoint, which holds no LoRA slots or draft model; "
                             "use level 1.")
        sleep_mode.unbind_kv_caches(self._models())
        self.kv_caches, self.state_caches = [], []
        if self.kv_offload is not None:  # it holds the caches (the engine forgot the tier's keys)
            self.kv_offload.close()
            self.kv_offload = None
        self._sleeping_weights: Optional[sleep_mode.SleepingWeights] = sleep_mode.SleepingWeights(self._models(), level)
        current_platform.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Put back what ``sleep`` took: ``"weights"`` (from the file, or loaded again at
        level 2) and / or ``"kv_cache"`` (allocated again, empty)."""
        if "weights" in tags and self._sleeping_weights is not None:
            self._sleeping_weights.wake_up(lambda: get_model(self.model_config, self.device, self.attn_backend))
            self._sleeping_weights = None
            current_platform.empty_cache()  # a reloaded model's memory (level 2)
        if "kv_cache" in tags:
            self.initialize_kv_cache(self.num_blocks)

    # ------------------------------------------------------------------ set-up
    def _allocate_kv_caches(self, num_blocks: int, zeroed: bool = False) -> list[torch.Tensor]:
        """The cache tensors (one per layer of a group), in the cache dtype (see
        ``bind_kv_caches``); block 0 zeroed where it is the null block."""
        return bind_kv_caches(self.attention_layers, num_blocks, self.block_size, self.kv_cache_dtype,
                              self.device, zeroed, self._layer_groups, self.kv_cache_groups.has_local_attention)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Peak activation memory (bytes): the larger of a forward over ``max_num_batched_tokens``
        tokens (``Platform.profile_activation_peak``) and, for an image-text model, its vision
        encoder on the largest image the limits allow (``Platform.profile_peak`` of
        ``get_multimodal_embeddings`` on ``pagedllm.multimodal.profiling.dummy_image_inputs``).

        Raises:
            ValueError: the model's processor refuses the dummy image.
        """
        peak = current_platform.profile_activation_peak(self._dummy_run, self.scheduler_config.max_num_batched_tokens)
        if not hasattr(self.model, "get_multimodal_embeddings") or not self.pp.is_first_rank:
            return peak
        from pagedllm.multimodal.profiling import dummy_image_inputs

        inputs = dummy_image_inputs(self.model_config)
        if inputs is None:
            return peak
        inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
        encoder_peak = current_platform.profile_peak(lambda: self.model.get_multimodal_embeddings(**inputs))
        logger.info("Memory profile: %.1f MiB for %d tokens, %.1f MiB for the vision encoder on the largest image",
                    peak / 2**20, self.scheduler_config.max_num_batched_tokens, encoder_peak / 2**20)
        return max(peak, encoder_peak)

    def _dummy_run(self, num_tokens: int) -> None:
        """Forward ``num_tokens`` tokens as prefills of at most ``max_model_len`` tokens each,
        with a temporary KV cache (and state slots) just large enough (for the platform's
        memory profiling)."""
        seq_len = min(num_tokens, self.model_config.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._allocate_kv_caches(num_seqs * blocks_per_seq, zeroed=True)
        lens = np.array([seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else []))
        positions = np.concatenate([np.arange(n) for n in lens])
        seq_starts = np.repeat(np.arange(len(lens)) * blocks_per_seq * self.block_size, lens)
        query_start_loc = np.concatenate(([0], np.cumsum(lens)))
        metadata = [self.attn_metadata_builder.build(
            CommonAttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=lens,
                num_computed_tokens=np.zeros_like(lens),
                block_table=np.arange(num_seqs * blocks_per_seq).reshape(num_seqs, blocks_per_seq),
                slot_mapping=seq_starts + positions,
                num_decodes=0,
            )
        )] * len(self.kv_cache_groups.groups)
        bind_state_caches(self.state_layers, self._state_layer_groups, len(lens), self.device)
        metadata += [build_mamba_metadata(query_start_loc, np.arange(len(lens)), np.zeros_like(lens), 0, self.device)
                     ] * len(self.kv_cache_groups.state_groups)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = self._to_device(positions)
        intermediate = None
        if not self.pp.is_first_rank:
            intermediate = {name: torch.zeros(shape, dtype=dtype, device=self.device)
                            for name, (shape, dtype) in self._intermediate_specs(num_tokens).items()}
        with set_forward_context(metadata):
            hidden = self.model(input_ids, positions, intermediate)
        if self.pp.is_last_rank and self.pooler is None:
            self.model.compute_logits(hidden[: self.scheduler_config.max_num_seqs])
        for layer in self.attention_layers:
            layer.kv_cache = torch.empty(0)
        for state_layer in self.state_layers:
            state_layer.kv_cache = []

    # ------------------------------------------------------------------ steps
    def _update_states(self, so: SchedulerOutput) -> None:
        if self.state_layers:
            self._plan_state_copies(so)
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            if isinstance(self.proposer, DraftModelProposer) and req_id in batch.requests:
                self.proposer.discard(batch.requests[req_id].row)
            batch.remove_request(req_id)
            self._draft_probs.pop(req_id, None)
            self._pooling_states.pop(req_id, None)
            self._mm_features.pop(req_id, None)
            self._mrope_positions.pop(req_id, None)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for new in so.scheduled_new_reqs:
            batch.add_request(new)
            if new.mm_features:
                self._mm_features[new.req_id] = new.mm_features
            if self.uses_mrope:
                self._mrope_positions[new.req_id] = self.model.get_mrope_input_positions(
                    new.token_ids[: new.num_prompt_tokens], new.mm_features)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = batch.requests[req_id]
            batch.append_block_ids(state.row, block_ids)
            batch.num_computed_tokens[state.row] = num_computed
        for req_id, num_computed, token_ids in zip(cached.req_ids, cached.num_computed_tokens, cached.new_token_ids):
            batch.write_tokens(batch.requests[req_id].row, num_computed, token_ids)

    def _plan_state_copies(self, so: SchedulerOutput) -> None:
        """The step's state-slot copies (see the class), as (state group, source slot,
        destination slot): ``_copies_in`` before the forward, ``_copies_out`` after it."""
        first = len(self.kv_cache_groups.groups)
        self._copies_in: list[tuple[int, int, int]] = []
        self._copies_out: list[tuple[int, int, int]] = []
        for new in so.scheduled_new_reqs:
            for group in range(first, self.kv_cache_groups.num_groups):
                working, *rest = new.block_ids[group]
                if new.num_computed_tokens > 0 and rest:
                    self._copies_in.append((group, rest.pop(0), working))
                if rest:
                    self._copies_out.append((group, working, rest[0]))
        cached = so.scheduled_cached_reqs
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids):
            for group in range(first, self.kv_cache_groups.num_groups):
                if block_ids[group]:
                    row = self.input_batch.requests[req_id].row
                    self._copies_out.append((group, int(self.input_batch.block_tables[group][row, 0]),
                                             block_ids[group][-1]))

    def _copy_states(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy each (state group, source, destination) slot in every tensor of the group's layers."""
        for group, src, dst in copies:
            for layer, layer_group in zip(self.state_layers, self._state_layer_groups):
                if layer_group == group:
                    for tensor in layer.kv_cache:
                        tensor[dst].copy_(tensor[src])

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """With experts spread over data-parallel engines, pass zero tokens through every MoE
        layer (``run_idle_exchanges``): this engine computes its experts for the others'
        tokens in a step that has none of its own. Nothing otherwise."""
        if self.config.parallel_config.data_parallel_expert_parallel:
            run_idle_exchanges(self.model, self.model_config.dtype, self.device)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: apply the second tier's transfers (if any), update the persistent
        batch, forward all scheduled tokens, sample.

        Returns:
            the sampled token ids (and logprobs) of requests whose known tokens are now all
            computed; requests in the middle of their prompt sample nothing; with a second
            tier, the requests whose loads are now written.
        """
        offload = self.kv_offload
        if offload is None:
            return self._execute_model(so)
        offload.submit(so.kv_transfers)
        offload.wait_for(new.req_id for new in so.scheduled_new_reqs)
        output = self._execute_model(so)
        # NOTE: a step with nothing to run (only loads pending) waits a little for them, not to spin.
        finished = offload.get_finished(timeout=0.002 if so.is_empty else 0.0)
        return dataclasses.replace(output, finished_recving=finished) if finished else output

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            self.execute_dummy_batch()  # a step that runs no token still joins the engines' exchanges
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        decodes = [r for r, n in so.num_scheduled_tokens.items() if n == 1]
        prefills = [r for r, n in so.num_scheduled_tokens.items() if n > 1]
        request_slots, failed_req_ids = self._activate_loras(decodes, prefills)
        order = decodes + prefills
        states = [batch.requests[r] for r in order]
        spec = so.scheduled_spec_decode_tokens
        for req_id, drafts in spec.items():
            state = batch.requests[req_id]
            start = batch.num_tokens[state.row]
            batch.token_ids[state.row, start : start + len(drafts)] = drafts
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
        block_index, offset = positions // bs, positions % bs
        seq_lens = computed + num_sched
        num_attention_groups = len(self.kv_cache_groups.groups)
        ranges = self._bidirectional_ranges(order, computed, seq_lens)
        metadata = [self._attention_metadata(table, rows, seq_lens, computed, cu, len(decodes),
                                             table[token_rows, block_index] * bs + offset, ranges)
                    for table in batch.block_tables[:num_attention_groups]]
        if self.state_layers:
            metadata += self._state_metadata(batch.block_tables[num_attention_groups:], rows, computed, cu,
                                             len(decodes))
        if self.lora_manager is not None:
            self.lora_manager.set_token_slots(np.array([request_slots[r] for r in order], dtype=np.int64)[token_req])

        kv_metadata = so.kv_connector_metadata
        if self.kv_connector is not None and kv_metadata is not None:
            # NOTE: a request whose load failed runs on whatever its blocks hold; the scheduler aborts it.
            failed_req_ids.update(self.kv_connector.start_load_kv(kv_metadata))
        input_ids_t, positions_t = self._to_device(input_ids), self._to_device(positions)
        model_positions_t = self._model_positions(order, positions, token_req, positions_t)
        inputs_embeds = self._multimodal_embeds(so, order, computed, num_sched, starts, input_ids_t)
        if self.state_layers:
            self._copy_states(self._copies_in)
        with set_forward_context(metadata):
            hidden = self._forward_stage(input_ids_t, model_positions_t, inputs_embeds)
        if self.state_layers:
            self._copy_states(self._copies_out)
        if self.kv_connector is not None and kv_metadata is not None:
            self.kv_connector.save_kv(kv_metadata)

        batch.num_computed_tokens[rows] = seq_lens
        if not self.pp.is_last_rank:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.pooler is not None:
            return self._pool(hidden, order, states, starts, num_sched, seq_lens)
        prompt_logprobs = self._prompt_logprobs(hidden, states, computed, seq_lens, starts)
        num_drafts = np.fromiter((len(spec.get(r, ())) for r in order), dtype=np.int64, count=len(order))
        logits_indices, sample_reqs = self._logits_indices(rows, seq_lens, cu, num_drafts)
        sample_rows = rows[sample_reqs]
        num_output_tokens = np.maximum(positions[logits_indices] + 1 - batch.num_prompt_tokens[sample_rows], 0)
        bitmask = sampled_rows_bitmask(so, order, sample_reqs, self.device)
        tokens, logprobs, logits, sampling = self._sample(hidden, logits_indices, sample_rows, num_output_tokens,
                                                          bitmask)
        sampled_token_ids: list[list[int]] = [[] for _ in order]
        logprobs_index: dict[int, int] = {}
        target_probs: list[torch.Tensor] = []
        last_accepted: list[int] = []  # per request that sampled: index of its last accepted position
        j = 0
        for i, count in zip(*(a.tolist() for a in np.unique(sample_reqs, return_counts=True))):
            state = states[i]
            kept = self._verify(state.req_id, spec.get(state.req_id), tokens[j : j + count], j,
                                logits, sampling, logprobs, target_probs,
                                state.req_id in so.structured_output_request_ids)
            if state.sampling_params.logprobs is not None:
                logprobs_index[i] = j
            sampled_token_ids[i] = kept
            for token in kept:
                batch.append_token(state, token)
            batch.num_computed_tokens[state.row] -= count - len(kept)
            last_accepted.append(j + len(kept) - 1)
            j += count
        num_drafts = self._num_drafts_to_propose(so, order, sampled_token_ids)
        proposing = np.flatnonzero(num_drafts)
        if isinstance(self.proposer, DraftModelProposer):
            next_positions = np.minimum(positions + 1, self.model_config.max_model_len - 1)
            self.proposer.forward_step(TargetStep(
                input_ids_t, positions_t, self._to_device(batch.token_ids[token_rows, next_positions]), hidden,
                metadata[0], logits_indices[np.array(last_accepted, dtype=np.int64)], rows[np.unique(sample_reqs)],
                batch.token_ids, batch.num_tokens, batch.block_table,
            ), rows[proposing])
        return ModelRunnerOutput(
            req_ids=order,
            req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            logprobs_index=logprobs_index,
            prompt_logprobs_dict=prompt_logprobs,
            failed_req_ids=failed_req_ids,
            spec_token_ids=self._propose(order, rows, proposing, num_drafts[proposing]),
        )

    def _pool(self, hidden: torch.Tensor, order: list[str], states: list[CachedRequestState], starts: np.ndarray,
              num_sched: np.ndarray, seq_lens: np.ndarray) -> ModelRunnerOutput:
        """A pooling model's step: each request's chunk of ``hidden`` [T, hidden] (rows
        ``starts[i]`` .. + ``num_sched[i]``) goes into its pooling state; the requests whose
        prompt is now all computed return their pooled vector and sample nothing."""
        assert self.pooler is not None
        pooler_output: dict[str, list[float]] = {}
        for i, state in enumerate(states):
            start = int(starts[i])
            pooling = self.pooler.update(self._pooling_states.pop(state.req_id, None),
                                         hidden[start : start + int(num_sched[i])])
            if int(seq_lens[i]) < state.num_prompt_tokens:
                self._pooling_states[state.req_id] = pooling
            else:
                pooler_output[state.req_id] = self.pooler.finish(pooling).tolist()
        return ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                 sampled_token_ids=[[] for _ in order], pooler_output=pooler_output)

    def _num_drafts_to_propose(self, so: SchedulerOutput, order: list[str],
                               sampled_token_ids: list[list[int]]) -> np.ndarray:
        """[len(order)] int64: how many drafts to propose for each request of the step: the
        scheduler's choice (``SchedulerOutput.num_speculative_tokens``; without one,
        ``num_speculative_tokens``) for those that sampled, else 0 (0 too without
        speculative decoding)."""
        if self.proposer is None:
            return np.zeros(len(order), dtype=np.int64)
        k = self.config.speculative_config.num_speculative_tokens  # type: ignore[union-attr]
        chosen = so.num_speculative_tokens
        return np.fromiter((chosen.get(r, k) if tokens else 0 for r, tokens in zip(order, sampled_token_ids)),
                           dtype=np.int64, count=len(order))

    def _intermediate_specs(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the tensors passed between pipeline stages: the
        hidden states and the residual, [num_tokens, hidden] each, in the model dtype."""
        shape = (num_tokens, self.model_config.hf_config.hidden_size)
        return {"hidden_states": (shape, self.model_config.dtype), "residual": (shape, self.model_config.dtype)}

    def _forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This stage's forward over the step's tokens: after receiving the previous stage's
        hidden states (unless first), and sending its own on (unless last). Returns the
        final hidden states [T, hidden] on the last stage (other stages' return is unused).
        ``inputs_embeds``: an image-text model's token embeddings with the images merged in."""
        intermediate = None
        if not self.pp.is_first_rank:
            intermediate = self.pp.recv_tensor_dict(self._intermediate_specs(input_ids.shape[0]), self.device)
        if inputs_embeds is None:
            out = self.model(input_ids, positions, intermediate)
        else:
            out = self.model(input_ids, positions, intermediate, inputs_embeds=inputs_embeds)
        if not self.pp.is_last_rank:
            self.pp.send_tensor_dict(out)
        return out

    def _model_positions(self, order: list[str], positions: np.ndarray, token_req: np.ndarray,
                         positions_t: torch.Tensor) -> torch.Tensor:
        """The positions the model takes for the step's tokens: ``positions_t`` ([T] int64, each
        token's index in its request) or, for a multimodal-RoPE model, [3, T] int64: a prompt
        token's rows as the model computed them, a later token's index plus the request's
        ``mrope_position_delta`` on every row."""
        if not self.uses_mrope:
            return positions_t
        rows = np.repeat(positions[None, :], 3, axis=0)
        for i, req_id in enumerate(order):
            prompt_positions, delta = self._mrope_positions[req_id]
            tokens = np.flatnonzero(token_req == i)
            index = positions[tokens]
            in_prompt = index < prompt_positions.shape[1]
            rows[:, tokens[in_prompt]] = prompt_positions[:, index[in_prompt]]
            rows[:, tokens[~in_prompt]] += delta
        return self._to_device(rows)

    def _run_encoders(self, so: SchedulerOutput) -> None:
        """Run the vision encoder on each image of ``so.scheduled_encoder_inputs``, one at a
        time, into ``encoder_cache``.

        Raises:
            ValueError: an image's embeddings are not as many as its placeholders take (``num_embeds``).
        """
        names = self.model.mm_input_names
        for req_id, input_ids in so.scheduled_encoder_inputs.items():
            for input_id in input_ids:
                feature = self._mm_features[req_id][input_id]
                inputs = {name: feature.data[name].to_tensor().to(self.device) for name in names if name in feature.data}
                embeds = self.model.get_multimodal_embeddings(**inputs)[0]
                if embeds.shape[0] != feature.mm_position.num_embeds:
                    raise ValueError(f"An image's encoder gave {embeds.shape[0]} embeddings for its "
                                     f"{feature.mm_position.num_embeds} placeholder tokens.")
                self.encoder_cache[feature.identifier] = embeds

    def _multimodal_embeds(self, so: SchedulerOutput, order: list[str], computed: np.ndarray, num_sched: np.ndarray,
                           starts: np.ndarray, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """An image-text model's step inputs (first pipeline stage): the token embeddings of
        ``input_ids`` [T] with, at every scheduled placeholder position that takes an embedding,
        its image's embedding row (from ``encoder_cache``, after ``_run_encoders``); None when no
        request of the step has an image (the model embeds the tokens itself)."""
        if not self._mm_features or not self.pp.is_first_rank or not hasattr(self.model, "get_multimodal_embeddings"):
            return None
        self._run_encoders(so)
        rows, chunks = [], []
        for i, req_id in enumerate(order):
            first, last = int(computed[i]), int(computed[i] + num_sched[i])
            for feature in self._mm_features.get(req_id, ()):
                positions, lo, hi = feature.mm_position.embeds_in(first, last)
                if not positions:
                    continue
                chunks.append(self.encoder_cache[feature.identifier][lo:hi])
                rows.append(torch.tensor(positions) + int(starts[i]) - first)
        if not rows:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        embeds[torch.cat(rows).to(self.device)] = torch.cat(chunks).to(embeds.dtype)
        return embeds

    def _bidirectional_ranges(self, order: list[str], computed: np.ndarray, seq_lens: np.ndarray
                              ) -> Optional[np.ndarray]:
        """A ``BIDIRECTIONAL_IMAGE_ARCHITECTURES`` model's ``bidirectional_ranges`` of the step:
        [num_ranges, 3] int64 (index in ``order``, start, end) for each image whose placeholder
        tokens overlap the request's tokens ``computed`` .. ``seq_lens`` - 1; None for another
        model, or when no scheduled token is an image's.

        Raises:
            RuntimeError: a step that cuts an image's tokens (the scheduler's
                ``disable_chunked_mm_input`` prevents it).
        """
        if not self.bidirectional_images or not self._mm_features:
            return None
        ranges = []
        for i, req_id in enumerate(order):
            for feature in self._mm_features.get(req_id, ()):
                start, end = feature.mm_position.offset, feature.mm_position.end
                if start < seq_lens[i] and end > computed[i]:
                    if end > seq_lens[i]:
                        raise RuntimeError(f"Request {req_id}'s step ends inside an image's tokens "
                                           f"({start} .. {end - 1}).")
                    ranges.append((i, start, end))
        return np.array(ranges, dtype=np.int64) if ranges else None

    def _activate_loras(self, decodes: list[str], prefills: list[str]) -> tuple[dict[str, int], dict[str, str]]:
        """With LoRA: put the step's adapters in slots and sort ``decodes`` and ``prefills``
        (in place) by slot, so each slot's tokens form at most two runs (see
        ``pagedllm.lora.layers``). Returns request id -> slot (-1: none), and request id ->
        reason for requests whose adapter could not be loaded (they run on the base
        weights this step and the scheduler aborts them)."""
        if self.lora_manager is None:
            return {}, {}
        req_ids = decodes + prefills
        loras = [self.input_batch.requests[r].lora_request for r in req_ids]
        slots, failed = self.lora_manager.activate(loras)
        request_slots = dict(zip(req_ids, slots.tolist()))
        decodes.sort(key=request_slots.__getitem__)
        prefills.sort(key=request_slots.__getitem__)
        failed_req_ids = {r: failed[lora.adapter_key] for r, lora in zip(req_ids, loras)
                          if lora is not None and lora.adapter_key in failed}
        return request_slots, failed_req_ids

    def _verify(
        self, req_id: str, drafts: Optional[list[int]], target: list[int], first: int,
        logits: torch.Tensor, sampling: SamplingMetadata, logprobs: Optional[LogprobsLists],
        target_probs: list[torch.Tensor], constrained: bool = False,
    ) -> list[int]:
        """The tokens a request keeps of the ``target`` tokens sampled at its positions (rows
        ``first`` .. of ``logits``): all of them without drafts; with deterministic drafts
        the target's own up to and with the first that differs from its draft
        (``num_accepted_matching``); with sampled drafts those ``rejection_sample`` keeps,
        whose logprobs then replace the rows' in ``logprobs``. ``target_probs`` caches the
        step's ``Sampler.target_probs`` (computed once, when first needed).

        A ``constrained`` request's drafts (cut at the first its grammar refuses) are
        verified by matching even when sampled: the rule is exact for any proposal, while
        min(1, p / q) with the remainder drawn from norm(max(0, p - q)) is not for drafts
        that were cut after being drawn."""
        draft_probs = self._draft_probs.pop(req_id, None)
        if constrained:
            draft_probs = None
        if not drafts:
            return target
        if draft_probs is None:
            return target[: num_accepted_matching(target, drafts) + 1]
        if not target_probs:
            target_probs.append(self.sampler.target_probs(logits, sampling))
        kept = rejection_sample(target_probs[0][first : first + len(target)], draft_probs[: len(drafts)],
                                torch.tensor(drafts, device=self.device))
        self._replace_logprobs(logprobs, logits, first, kept, sampling.max_num_logprobs)
        return kept

    def _propose(self, order: list[str], rows: np.ndarray, proposing: np.ndarray,
                 num_drafts: np.ndarray) -> Optional[list[list[int]]]:
        """The proposer's drafts for each request of the step (``order``, batch ``rows``):
        ``num_drafts`` ([P] int64, >= 1) for each index in ``proposing`` ([P] int64), none
        for the others, keeping the distributions of sampled drafts for their
        verification; None without speculative decoding."""
        if self.proposer is None:
            return None
        drafts: list[list[int]] = [[] for _ in order]
        if len(proposing):
            batch = self.input_batch
            proposing_rows = rows[proposing]
            proposals, draft_probs = self.proposer.propose(
                proposing_rows, num_drafts, batch.token_ids, batch.num_tokens, batch.block_table,
                batch.draft_temperature(proposing_rows))
            for i, proposal in zip(proposing.tolist(), proposals):
                drafts[i] = proposal
            for j, probs in draft_probs.items():
                self._draft_probs[order[proposing[j]]] = probs
        return drafts

    @staticmethod
    def _replace_logprobs(logprobs: Optional[LogprobsLists], logits: torch.Tensor, first: int,
                          tokens: list[int], num_logprobs: Optional[int]) -> None:
        """Give rows ``first`` .. of ``logprobs`` the logprobs of ``tokens`` (the rejection
        sampler's, not the positions' own samples), from the raw ``logits`` [S, V]."""
        if logprobs is None or num_logprobs is None:
            return
        rows = slice(first, first + len(tokens))
        raw = torch.log_softmax(logits[rows].float(), dim=-1)
        ids, values, ranks = compute_logprobs_with_topk(raw, torch.tensor(tokens, device=logits.device), num_logprobs)
        logprobs.token_ids[rows], logprobs.logprobs[rows], logprobs.ranks[rows] = ids.tolist(), values.tolist(), ranks.tolist()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _attention_metadata(
        self,
        block_table: np.ndarray,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        computed: np.ndarray,
        cu: np.ndarray,
        num_decodes: int,
        slot_mapping: np.ndarray,
        bidirectional_ranges: Optional[np.ndarray] = None,
    ) -> AttentionMetadata:
        """One KV-cache group's metadata of the step, by the backend's builder: the group's
        ``block_table`` ([max_num_reqs, max_blocks] int64); ``rows`` / ``seq_lens`` /
        ``computed`` / ``cu`` (cumulative scheduled tokens) per request (decodes first),
        ``slot_mapping`` (in the group's blocks) per token; ``bidirectional_ranges`` as
        ``CommonAttentionMetadata``'s."""
        width = int(-(-seq_lens.max() // self.block_size))
        common = CommonAttentionMetadata(
            query_start_loc=np.concatenate(([0], cu)),
            seq_lens=seq_lens,
            num_computed_tokens=computed,
            block_table=block_table[rows, :width],
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            bidirectional_ranges=bidirectional_ranges,
        )
        return self.attn_metadata_builder.build(common)

    def _state_metadata(self, state_tables: list[np.ndarray], rows: np.ndarray, computed: np.ndarray,
                        cu: np.ndarray, num_decodes: int) -> list:
        """Each state group's ``MambaMetadata`` of the step (its slot table ``state_tables[s]``,
        [max_num_reqs, ...] int64, the slot in column 0; ``rows`` / ``computed`` / ``cu`` per
        request, decodes first); zeroes the slots of decodes that start from no state."""
        query_start_loc = np.concatenate(([0], cu))
        metadata = []
        for s, table in enumerate(state_tables):
            slots = table[rows, 0]
            group_id = len(self.kv_cache_groups.groups) + s
            zero_fresh_states([layer for layer, g in zip(self.state_layers, self._state_layer_groups) if g == group_id],
                              slots, computed, num_decodes)
            metadata.append(build_mamba_metadata(query_start_loc, slots, computed, num_decodes, self.device))
        return metadata

    def _logits_indices(
        self, rows: np.ndarray, seq_lens: np.ndarray, cu: np.ndarray, num_drafts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The flattened-token positions whose logits are sampled this step, and for each the
        index of its request in the step's order (non-decreasing; a request may have several
        consecutive positions: draft tokens to verify).

        A request whose known tokens are now all computed samples at its last known token
        and at each of its ``num_drafts`` draft tokens (the step's last 1 + d positions).
        """
        sample_reqs = np.flatnonzero(seq_lens == self.input_batch.num_tokens[rows] + num_drafts)
        counts = num_drafts[sample_reqs] + 1
        per_index = np.repeat(sample_reqs, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return cu[per_index] - np.repeat(counts, counts) + offsets, per_index

    def _sample(
        self, hidden: torch.Tensor, logits_indices: np.ndarray, sample_rows: np.ndarray,
        num_output_tokens: np.ndarray, bitmask: Optional[torch.Tensor] = None,
    ) -> tuple[list[int], Optional[LogprobsLists], Optional[torch.Tensor], Optional[SamplingMetadata]]:
        """Sample one token at each of ``logits_indices`` (flattened-token positions of
        ``hidden``), for the batch rows ``sample_rows`` that have ``num_output_tokens``
        output tokens before it, within ``bitmask`` (structured outputs; None: no
        constraint); returns the tokens, their logprobs when asked for, and the logits
        [S, V] and sampling metadata used (None when nothing is sampled)."""
        if len(logits_indices) == 0:
            return [], None, None, None
        logits = self.model.compute_logits(hidden[self._to_device(logits_indices)])
        metadata = self.input_batch.sampling_metadata(sample_rows, num_output_tokens, logits.shape[-1])
        metadata.allowed_token_bitmask = bitmask
        out = self.sampler(logits, metadata)
        tokens = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return tokens, None, logits, metadata
        return tokens, LogprobsLists(
            token_ids=out.logprob_token_ids.tolist(),  # type: ignore[union-attr]
            logprobs=out.logprobs.tolist(),
            ranks=out.ranks.tolist(),  # type: ignore[union-attr]
        ), logits, metadata

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
        """KV-cache bytes per token of a block: the target's cache tensors', plus the draft
        model's if any (``kv_cache_sizing.kv_bytes_per_block`` / block size)."""
        spec = self.config.speculative_config
        draft = spec.draft_model_config if spec else None
        return kv_bytes_per_block(self.model_config, self.kv_cache_groups, draft) // self.block_size
