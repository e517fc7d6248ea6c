"""ModernBERT encoders (``ModernBertModel``, ``ModernBertForSequenceClassification``) on the
pooling runner equal to the references on tiny checkpoints transformers writes: the
embeddings of a sentence-transformers folder equal its ``encode``, the classifier's
probabilities transformers' softmax of its logits. The texts reach past the local layers'
window (4 positions either side), so the alternating global / local attention and the two
rope bases all count."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm import LLM
from tests.fixtures.encoders import TEXTS, make_encoder, make_sentence_transformer
from tests.helpers import check_block_accounting
from tests.models.test_bert import assert_close_embeddings

#: ``TEXTS`` and a longer one (17 tokens with [CLS] / [SEP]).
LONG_TEXTS = [*TEXTS, "the cat and the dog run fast with the good cat and the bad dog on it"]


def test_modernbert_sentence_transformers_folder_equals_its_encode(tmp_path):
    from sentence_transformers import SentenceTransformer

    path = make_sentence_transformer(make_encoder(tmp_path / "raw", "ModernBertModel", seed=1), tmp_path / "st",
                                     "mean", normalize=True)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    model_config = llm.llm_engine.config.model_config
    assert (model_config.runner_type, model_config.pooler_config.pooling_type) == ("pooling", "MEAN")
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching  # an encoder: bidirectional
    got = torch.tensor([out.outputs.embedding for out in llm.embed(LONG_TEXTS, use_tqdm=False)])
    ref = SentenceTransformer(str(path), device="cpu").encode(LONG_TEXTS, convert_to_tensor=True)
    assert_close_embeddings(got, ref.float())
    check_block_accounting(llm)


def test_modernbert_classifier_mean_pooling_equals_transformers(tmp_path):
    """``classifier_pooling`` "mean" is the pooler's default; biases on (``norm_bias``,
    ``attention_bias``, ``mlp_bias``, ``classifier_bias``); softmax over 3 labels."""
    path = make_encoder(tmp_path, "ModernBertForSequenceClassification", seed=2, num_labels=3,
                        classifier_pooling="mean", norm_bias=True, attention_bias=True, mlp_bias=True,
                        classifier_bias=True)
    model = transformers.ModernBertForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = torch.stack([model(**tokenizer(t, return_tensors="pt")).logits[0] for t in LONG_TEXTS])
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "MEAN"
    probs = torch.tensor([out.outputs.probs for out in llm.classify(LONG_TEXTS, use_tqdm=False)])
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), atol=1e-5, rtol=1e-4)
    check_block_accounting(llm)


def test_modernbert_cls_keeps_no_kv_cache_and_truncates_long_prompts(tmp_path, caplog):
    """CLS pooling equals sentence-transformers' ``encode``; an encoder gets no KV-cache blocks
    (admission by ``max_num_seqs`` alone: 5 prompts through 2 rows); a prompt over
    ``max_model_len`` is refused, or cut to its last ``truncate_prompt_tokens`` tokens (vLLM's
    left truncation), which equal transformers' CLS state of those tokens."""
    from sentence_transformers import SentenceTransformer

    raw = make_encoder(tmp_path / "raw", "ModernBertModel", seed=3)
    path = make_sentence_transformer(raw, tmp_path / "st", "cls", normalize=False)
    with caplog.at_level("INFO", logger="pagedllm.worker.kv_cache_sizing"):
        llm = LLM(str(path), dtype="float32", max_num_seqs=2)
    assert "KV cache: none (ModernBertModel is encoder-only" in caplog.text
    core = llm.llm_engine.engine_core
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "CLS"
    assert core.num_gpu_blocks == 0 and not core.kv_cache_manager.kv_cache_groups.num_groups
    got = torch.tensor([out.outputs.embedding for out in llm.embed(LONG_TEXTS, use_tqdm=False)])
    ref = SentenceTransformer(str(path), device="cpu").encode(LONG_TEXTS, convert_to_tensor=True).float()
    cosine = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
    assert bool((cosine >= 0.99999).all()), cosine
    assert_close_embeddings(got, ref)

    tokenizer = transformers.AutoTokenizer.from_pretrained(raw)
    long_prompt = [tokenizer.cls_token_id] + [7 + i % 30 for i in range(80)] + [tokenizer.sep_token_id]
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.embed([long_prompt], use_tqdm=False)
    cut = llm.embed([long_prompt], truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long_prompt[-20:]
    hf = transformers.AutoModel.from_pretrained(raw, dtype=torch.float32).eval()
    with torch.no_grad():
        cls_state = hf(torch.tensor([long_prompt[-20:]])).last_hidden_state[0, 0]
    assert_close_embeddings(torch.tensor([cut.outputs.embedding]), cls_state[None])
    check_block_accounting(llm)
