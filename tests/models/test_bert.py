"""BERT-style encoders served as embedding models (``--runner auto`` -> pooling) equal to the
reference: sentence-transformers' ``encode`` of a folder it wrote, and transformers' own
last hidden states pooled; every prompt computed whole (no chunked prefill)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.pooling_params import PoolingParams
from tests.fixtures.encoders import TEXTS, make_encoder, make_sentence_transformer
from tests.helpers import check_block_accounting


def assert_close_embeddings(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Each row within 1e-4 of cosine 1 and 1e-4 elementwise of the reference."""
    cosine = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
    assert bool((cosine > 1 - 1e-4).all()), cosine
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def bert_st(tmp_path_factory):
    """A tiny BertModel in a sentence-transformers folder: MEAN pooling, then Normalize."""
    tmp = tmp_path_factory.mktemp("bert-st")
    return make_sentence_transformer(make_encoder(tmp / "raw", "BertModel"), tmp / "st", "mean", normalize=True)


def test_bert_sentence_transformers_folder_equals_its_encode(bert_st):
    from sentence_transformers import SentenceTransformer

    llm = LLM(str(bert_st), dtype="float32", kv_cache_memory_bytes=4 << 20)
    model_config = llm.llm_engine.config.model_config
    assert model_config.runner_type == "pooling"
    assert (model_config.pooler_config.pooling_type, model_config.pooler_config.normalize) == ("MEAN", True)
    got = torch.tensor([out.outputs.embedding for out in llm.embed(TEXTS, use_tqdm=False)])
    ref = SentenceTransformer(str(bert_st), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert_close_embeddings(got, ref.float())
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="is a pooling model"):
        llm.generate("hello world")
    check_block_accounting(llm)


def test_roberta_cls_equals_transformers_whole_prompts(tmp_path):
    """RoBERTa's positions (from pad_token_id + 1, padding tokens at pad_token_id), CLS pooling
    (the encoder default) unnormalized; prompts up to max_model_len, two per step at most,
    none cut: a step's budget of one max_model_len leaves later prompts waiting. No KV cache,
    whatever ``num_gpu_blocks_override`` says: admission by the step budget and max_num_seqs alone."""
    from transformers import AutoModel

    path = make_encoder(tmp_path, "RobertaModel", seed=1)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=16, pooler_config={"normalize": False},
              max_num_batched_tokens=64, max_num_seqs=2)
    assert llm.llm_engine.engine_core.num_gpu_blocks == 0
    assert llm.llm_engine.config.model_config.max_model_len == 64
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "CLS"
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    prompts[1][3] = tokenizer.pad_token_id  # a padding token inside a prompt keeps position pad_token_id
    prompts.append([tokenizer.cls_token_id] + [7 + i % 20 for i in range(62)] + [tokenizer.sep_token_id])
    got = torch.tensor([out.outputs.embedding for out in llm.embed(prompts, use_tqdm=False)])
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).last_hidden_state[0, 0] for p in prompts])
    assert_close_embeddings(got, ref)
    check_block_accounting(llm)


def test_encoder_needs_a_step_budget_of_a_whole_prompt(bert_st):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than max_model_len \(64\)"):
        EngineArgs(model=str(bert_st), max_num_batched_tokens=32).create_engine_config(log_choices=False)
    with pytest.raises(ValueError, match="BertModel is an encoder"):
        EngineArgs(model=str(bert_st), runner="generate").create_engine_config(log_choices=False)


def test_one_step_of_shared_and_distinct_lengths_equals_transformers(bert_st):
    """One step holding two prompts of one length (a batched attention call), one of another
    length and a max_model_len prompt (each attended in place): every embedding equals
    transformers' MEAN pooled and normalized over that prompt alone."""
    from transformers import AutoModel

    llm = LLM(str(bert_st), dtype="float32", max_num_batched_tokens=256, kv_cache_memory_bytes=4 << 20)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in ("the cat is fast", "a dog was slow", "hello world")]
    prompts.append([tokenizer.cls_token_id] + [7 + i % 20 for i in range(62)] + [tokenizer.sep_token_id])
    assert len(prompts[0]) == len(prompts[1]) != len(prompts[2])
    got = torch.tensor([out.outputs.embedding for out in llm.embed(prompts, use_tqdm=False)])
    hf = AutoModel.from_pretrained(bert_st, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).last_hidden_state[0].mean(dim=0) for p in prompts])
    assert_close_embeddings(got, torch.nn.functional.normalize(ref, dim=-1))
    check_block_accounting(llm)
