"""``ParallelConfig.verify_with_model_config``: the start-up errors for tensor-parallel sizes
that do not split the model, naming the numbers; more pipeline stages than layers; data and
tensor parallelism together; --enable-expert-parallel reaching it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.config import ParallelConfig


def _model(heads: int, kv_heads: int, vocab: int = 1024, layers: int = 4) -> SimpleNamespace:
    return SimpleNamespace(hf_config=SimpleNamespace(num_attention_heads=heads), num_kv_heads=kv_heads, vocab_size=vocab,
                           num_layers=layers)


@pytest.mark.parametrize("tp, heads, kv_heads", [(1, 14, 2), (2, 14, 2), (4, 8, 8), (8, 8, 2), (4, 4, 1)])
def test_sizes_that_split(tp, heads, kv_heads):
    ParallelConfig(tensor_parallel_size=tp).verify_with_model_config(_model(heads, kv_heads))


@pytest.mark.parametrize(
    "tp, model, message",
    [
        (4, _model(14, 2), "tensor_parallel_size 4 does not divide the model's num_attention_heads 14."),
        (3, _model(6, 4), "tensor_parallel_size 3 and the model's num_key_value_heads 4: neither divides the other."),
        (2, _model(4, 2, vocab=1023), "tensor_parallel_size 2 does not divide the model's vocab_size 1023."),
        (0, _model(4, 2), r"tensor_parallel_size \(0\) and pipeline_parallel_size \(1\) must be at least 1."),
    ],
)
def test_sizes_that_do_not_split_name_the_numbers(tp, model, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tensor_parallel_size=tp).verify_with_model_config(model)


def test_data_and_tensor_parallelism_together_place_workers_per_replica():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=3, data_parallel_rank=2)
    config.verify_with_model_config(_model(4, 2))
    assert (config.local_world_size, config.local_rank_offset) == (12, 8)
    assert (ParallelConfig().local_world_size, ParallelConfig().local_rank_offset) == (1, 0)
    with pytest.raises(ValueError, match="data_parallel_size 2 with the Ray executor is not supported yet"):
        ParallelConfig(
            tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="ray"
        ).verify_with_model_config(_model(4, 2))
    ParallelConfig(data_parallel_size=2, distributed_executor_backend="ray").verify_with_model_config(_model(4, 2))


def test_pipeline_stages_need_a_layer_each():
    ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=4).verify_with_model_config(_model(4, 2, layers=4))
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 exceeds the model's num_hidden_layers 4: every stage"):
        ParallelConfig(pipeline_parallel_size=5).verify_with_model_config(_model(4, 2, layers=4))


def test_enable_expert_parallel_flag_reaches_the_parallel_config():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.openai.cli_args import engine_args_from

    for argv, expected in (([], False), (["--enable-expert-parallel"], True)):
        args = build_parser().parse_args(["serve", "-tp", "2", *argv])
        args.model = args.model_tag or args.model
        config = ParallelConfig.from_engine_args(engine_args_from(args), _model(4, 2))
        assert config.enable_expert_parallel is expected
