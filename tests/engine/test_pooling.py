"""Decoder checkpoints served as embedders (``--convert embed``): the pooled vector equals
transformers' last hidden states pooled, also when prompts are cut into chunks over several
steps (chunked prefill), and with prefix caching for LAST pooling; a pooling request
generates nothing and frees its blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine.processor import Processor
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.tokenizer import get_tokenizer
from tests.helpers import check_block_accounting, random_prompts

PROMPT_LENGTHS = [5, 37, 20]


@pytest.fixture(scope="module")
def qwen3_hidden(tiny_qwen3):
    """(prompts, transformers' last hidden states [len, hidden] of each) of the tiny Qwen3."""
    prompts = random_prompts(PROMPT_LENGTHS, 1000, seed=3)
    model = AutoModel.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        return prompts, [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def _embeddings(outputs) -> list[torch.Tensor]:
    return [torch.tensor(out.outputs.embedding) for out in outputs]


def _assert_cosine_one(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    for g, r in zip(got, ref):
        assert torch.nn.functional.cosine_similarity(g.double(), r.double(), dim=0) > 1 - 1e-4
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_convert_embed_last_token_normalized_in_chunks(tiny_qwen3, qwen3_hidden):
    """LAST pooling of a causal model keeps prefix caching (vLLM's rule): a repeated prompt
    hits its two full blocks, and its embedding equals the cold one."""
    prompts, hidden = qwen3_hidden
    llm = LLM(str(tiny_qwen3), dtype="float32", convert="embed", max_num_batched_tokens=16,
              kv_cache_memory_bytes=16 << 20)
    config = llm.llm_engine.config
    assert config.model_config.runner_type == "pooling" and config.cache_config.enable_prefix_caching
    assert llm.llm_engine.engine_core.num_gpu_blocks > 0  # causal: a paged KV cache, unlike an encoder
    pooler = config.model_config.pooler_config
    assert (pooler.pooling_type, pooler.normalize) == ("LAST", True)
    got = _embeddings(llm.embed(prompts, use_tqdm=False))
    _assert_cosine_one(got, [torch.nn.functional.normalize(h[-1], dim=0) for h in hidden])
    warm = llm.embed(prompts[1:2], use_tqdm=False)
    assert warm[0].num_cached_tokens == 32  # 37 tokens: two full 16-token blocks
    torch.testing.assert_close(_embeddings(warm)[0], got[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="is a pooling model"):
        llm.generate(prompts[0])
    check_block_accounting(llm)


def test_vllms_task_keyword_picks_the_runner(tiny_qwen3, qwen3_hidden):
    """vLLM's earlier ``task``: "embed" serves a causal checkpoint as ``convert="embed"`` does
    (the same embeddings), "generate" as a generative model; an explicit runner wins, and a task
    not built is refused naming the ones that are."""
    from pagedllm.config.pooler import runner_and_convert

    assert runner_and_convert("embed", "auto", "auto", "Qwen3ForCausalLM") == ("pooling", "embed")
    assert runner_and_convert("embedding", "auto", "auto", "BertModel") == ("pooling", "auto")
    assert runner_and_convert("classify", "auto", "auto", "Qwen3ForCausalLM") == ("pooling", "classify")
    assert runner_and_convert("score", "auto", "auto", "BertForSequenceClassification") == ("pooling", "auto")
    assert runner_and_convert("generate", "auto", "auto", "Qwen3ForCausalLM") == ("generate", "auto")
    assert runner_and_convert("embed", "pooling", "none", "Qwen3ForCausalLM") == ("pooling", "none")
    with pytest.raises(ValueError, match=r"task='reward' is not supported yet \(.*\); supported: None, 'auto', 'generate'"):
        LLM(str(tiny_qwen3), task="reward")
    prompts, hidden = qwen3_hidden
    llm = LLM(str(tiny_qwen3), dtype="float32", task="embed", kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.config.model_config.runner_type == "pooling"
    _assert_cosine_one(_embeddings(llm.embed(prompts, use_tqdm=False)),
                       [torch.nn.functional.normalize(h[-1], dim=0) for h in hidden])
    check_block_accounting(llm)


def test_mean_pooling_accumulates_over_chunks(tiny_qwen3, qwen3_hidden):
    """MEAN over prompts cut into 8-token chunks; ``PoolingParams.normalize`` per request over
    the model's ``normalize: false``; ``LLM.encode`` returns ``PoolingRequestOutput``s."""
    prompts, hidden = qwen3_hidden
    llm = LLM(str(tiny_qwen3), dtype="float32", convert="embed", max_num_batched_tokens=8,
              pooler_config={"pooling_type": "MEAN", "normalize": False}, kv_cache_memory_bytes=16 << 20)
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching  # MEAN reads every token
    params = [PoolingParams(), PoolingParams(normalize=True), PoolingParams()]
    outputs = llm.encode(prompts, params, use_tqdm=False)
    assert all(isinstance(out, PoolingRequestOutput) and out.finished for out in outputs)
    assert [len(out.prompt_token_ids) for out in outputs] == PROMPT_LENGTHS
    means = [h.mean(dim=0) for h in hidden]
    means[1] = torch.nn.functional.normalize(means[1], dim=0)
    _assert_cosine_one([torch.tensor(out.outputs.data) for out in outputs], means)
    check_block_accounting(llm)


def test_a_generative_model_computes_no_embeddings(tiny_qwen3):
    model_config = EngineArgs(model=str(tiny_qwen3)).create_engine_config(log_choices=False).model_config
    assert model_config.runner_type == "generate" and model_config.pooler_config is None
    processor = Processor(model_config, get_tokenizer(tiny_qwen3))
    with pytest.raises(ValueError, match="is a generative model: it computes no embeddings"):
        processor.process_pooling("r0", [5, 6, 7], PoolingParams())
    with pytest.raises(ValueError, match="pooler_config is set, but the model is not a pooling model"):
        EngineArgs(model=str(tiny_qwen3), pooler_config={"pooling_type": "MEAN"}).create_engine_config(
            log_choices=False)
