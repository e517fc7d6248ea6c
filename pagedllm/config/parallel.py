"""``ParallelConfig``: tensor, pipeline and data parallelism, and the executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from pagedllm.config.engine_args import EngineArgs
    from pagedllm.config.model import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """How the model spreads over devices: parallel sizes and the executor.

    ``data_parallel_size`` counts engine replicas (vLLM's); it is not part of ``world_size``:
    each replica runs ``world_size`` workers of its own (``-dp 2 -tp 2``: 4 worker processes).
    ``data_parallel_rank``: the replica this configuration belongs to (set by the replica's
    engine process; its workers take the machine's units ``data_parallel_rank x world_size``
    onwards: see ``local_rank_offset``).

    ``distributed_executor_backend``: ``"uni"`` (one worker in the engine's process),
    ``"mp"`` (one worker process per rank), ``"ray"`` (one Ray actor per rank, on the nodes
    of a Ray cluster), an ``Executor`` subclass, or None: ``"uni"`` for a world size of 1,
    else ``"ray"`` when this process is connected to Ray (or, on GPUs, for more ranks than
    the machine's devices) and ``"mp"`` otherwise (see ``pagedllm.executor.selector.get_executor_class``).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Union[str, type, None] = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    #: Mixture-of-experts layers place whole experts over the tensor-parallel ranks
    #: (``--enable-expert-parallel``; ``pagedllm.model_executor.layers.fused_moe``).
    enable_expert_parallel: bool = False
    #: Derived, not a flag: ``-dp N --enable-expert-parallel`` on a mixture-of-experts model
    #: (vLLM's attention data parallelism): the replicas' experts are spread over them (replica
    #: r holds ``expert_range(E, N, r)``), they exchange tokens in every MoE layer and step in
    #: lockstep (``pagedllm.engine.dp_lockstep``). False for a dense model: independent replicas.
    data_parallel_expert_parallel: bool = False
    #: The ``torch.distributed`` port (on 127.0.0.1) the replicas of a
    #: ``data_parallel_expert_parallel`` engine join on, chosen by the front end (vLLM's name).
    data_parallel_master_port: int = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, model_config: ModelConfig) -> ParallelConfig:
        """The parallel sizes and executor of ``args``, checked against the model.

        Raises:
            ValueError: see ``verify_with_model_config``.
        """
        config = cls(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            data_parallel_expert_parallel=(args.data_parallel_size > 1 and args.enable_expert_parallel
                                           and model_config.is_moe),
        )
        config.verify_with_model_config(model_config)
        if config.data_parallel_expert_parallel:
            check_data_parallel_expert_parallel(config, model_config, args.speculative_config is not None)
        return config

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Worker processes on this machine over all data-parallel replicas (one machine
        hosts all of them: ``data_parallel_size x world_size``)."""
        return self.data_parallel_size * self.world_size

    @property
    def local_rank_offset(self) -> int:
        """The machine-local rank of this replica's first worker: its workers are local
        ranks ``offset .. offset + world_size - 1`` of ``local_world_size`` (their cores on
        CPU, their devices on CUDA: ``Platform.bind_worker``)."""
        return self.data_parallel_rank * self.world_size

    @property
    def output_rank(self) -> int:
        """The global rank whose worker returns each step's ``ModelRunnerOutput``: tensor
        rank 0 of the last pipeline stage (rank 0 without pipeline parallelism)."""
        return self.world_size - self.tensor_parallel_size

    def verify_with_model_config(self, model_config: ModelConfig) -> None:
        """Check that the model splits over ``tensor_parallel_size`` ranks: the query heads
        and the vocabulary (no padding) by it, and KV heads by it or it by them (each KV
        head then held by ``tp / num_kv_heads`` ranks, as vLLM); that each of the
        ``pipeline_parallel_size`` stages gets at least one layer; and that data-parallel
        replicas with several workers each use the multiprocess executor (their workers are
        placed on this machine).

        Raises:
            ValueError: naming the sizes that do not divide, more stages than layers, or
                replicas of several workers on Ray.
        """
        tp = self.tensor_parallel_size
        if tp < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size ({tp}) and pipeline_parallel_size ({self.pipeline_parallel_size}) must be at least 1."
            )
        if self.data_parallel_size > 1 and self.world_size > 1 and self.distributed_executor_backend == "ray":
            raise ValueError(
                f"data_parallel_size {self.data_parallel_size} with the Ray executor is not supported yet "
                f"(replicas place their workers on this machine); use distributed_executor_backend 'mp'."
            )
        hf = model_config.hf_config
        num_heads, num_kv_heads, vocab = hf.num_attention_heads, model_config.num_kv_heads, model_config.vocab_size
        if num_heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's num_attention_heads {num_heads}."
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {tp} and the model's num_key_value_heads {num_kv_heads}: neither divides "
                f"the other."
            )
        if vocab % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's vocab_size {vocab}.")
        if self.pipeline_parallel_size > model_config.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {self.pipeline_parallel_size} exceeds the model's num_hidden_layers "
                f"{model_config.num_layers}: every stage needs at least one layer."
            )


def check_data_parallel_size(data_parallel_size: int, usage_context: str) -> None:
    """``data_parallel_size``: engine replicas behind one API server (``pagedllm serve -dp N``,
    vLLM's internal load balancing; see ``pagedllm.engine.dp_client``). Offline (``LLM``), vLLM
    runs one engine per process and leaves launching the ranks to the user; pagedllm refuses it.

    Raises:
        ValueError: a size below 1, or above 1 outside the API server (``usage_context`` "llm").
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
    if data_parallel_size > 1 and usage_context != "api_server":
        raise ValueError(
            f"data_parallel_size={data_parallel_size} is not supported yet offline (LLM runs one engine core); "
            f"serve the replicas behind one API server: pagedllm serve MODEL -dp {data_parallel_size}."
        )


def check_data_parallel_expert_parallel(config: ParallelConfig, model_config: ModelConfig,
                                        speculative: bool) -> None:
    """Refuse what ``-dp N --enable-expert-parallel`` (experts spread over the data-parallel
    replicas) is not built for: tensor or pipeline parallelism inside a replica, fewer experts
    than replicas, speculative decoding (a drafter's forwards would break the lockstep) and
    sleep mode (a sleeping replica cannot join its peers' exchanges).

    Raises:
        ValueError: naming the flags.
    """
    dp = config.data_parallel_size
    prefix = f"--data-parallel-size {dp} with --enable-expert-parallel"
    if config.pipeline_parallel_size > 1:
        raise ValueError(f"{prefix} is not supported yet with --pipeline-parallel-size "
                         f"{config.pipeline_parallel_size}.")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"{prefix} is not supported yet with --tensor-parallel-size "
                         f"{config.tensor_parallel_size} (the experts are spread over the replicas only).")
    if model_config.num_experts < dp:
        raise ValueError(f"{prefix} needs at least {dp} experts per layer (one per replica); "
                         f"{model_config.architecture} has {model_config.num_experts}.")
    if speculative:
        raise ValueError(f"{prefix} is not supported yet with --speculative-config (the replicas' forwards "
                         "must stay in lockstep).")
    if model_config.enable_sleep_mode:
        raise ValueError(f"{prefix} is not supported yet with --enable-sleep-mode (a sleeping replica cannot "
                         "join the others' expert exchanges).")
