"""ModernBERT encoders (``ModernBertModel``, ``ModernBertForSequenceClassification``) on the
pooling runner equal to the references on tiny checkpoints transformers writes: the
embeddings of a sentence-transformers folder equal its ``encode``, the classifier's
probabilities transformers' softmax of its logits. The texts reach past the local layers'
window (4 positions either side), so the alternating global / local attention and the two
rope bases all count."""

from __future__ import annotations

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
