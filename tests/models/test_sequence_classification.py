"""Sequence classifiers and scoring on the pooling runner: ``LLM.classify`` equals transformers'
activated logits (BERT, RoBERTa, Qwen3 ``*ForSequenceClassification``; ``--convert classify``),
``LLM.score`` of a BERT CrossEncoder equals sentence-transformers' ``CrossEncoder.predict``
(pairs with token types), a Qwen3-Reranker's (a Qwen3ForCausalLM with vLLM's hf_overrides)
its model card's p(yes), and an embedding model's score is the cosine of
sentence-transformers' embeddings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from pagedllm import LLM
from pagedllm.outputs import ClassificationRequestOutput, ScoringRequestOutput
from tests.fixtures.encoders import TEXTS, make_cross_encoder, make_encoder, make_sentence_transformer
from tests.helpers import check_block_accounting
from tests.models.rerankers import (
    QWEN3_RERANKER_TEMPLATE,
    RERANKER_OVERRIDES,
    card_document,
    card_query,
    card_scores,
    card_token_ids,
    make_qwen3_reranker,
)

QUERY = "the dog is fast"


def _logits(model_cls, path, texts: list[str], pairs: bool = False) -> torch.Tensor:
    """transformers' float32 logits [len(texts), num_labels], one prompt at a time."""
    model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        rows = [model(**tokenizer(*((QUERY, t) if pairs else (t,)), return_tensors="pt")).logits[0] for t in texts]
    return torch.stack(rows)


def _probs(outputs) -> torch.Tensor:
    assert all(isinstance(out, ClassificationRequestOutput) for out in outputs)
    return torch.tensor([out.outputs.probs for out in outputs], dtype=torch.float32)


def test_bert_cross_encoder_scores_equal_sentence_transformers(tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_cross_encoder(tmp_path / "ce", seed=1)
    reference = torch.tensor(CrossEncoder(str(path), device="cpu").predict([(QUERY, t) for t in TEXTS]))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    one_to_many = llm.score(QUERY, TEXTS, use_tqdm=False)
    many_to_many = llm.score([QUERY] * len(TEXTS), TEXTS, use_tqdm=False)
    for outputs in (one_to_many, many_to_many):
        assert all(isinstance(out, ScoringRequestOutput) for out in outputs)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in outputs], dtype=torch.float32),
                                   reference, atol=1e-4, rtol=1e-4)
    tokenizer = llm.get_tokenizer()
    assert one_to_many[1].prompt_token_ids == tokenizer(QUERY, TEXTS[1])["input_ids"]
    assert len(set(round(o.outputs.score, 6) for o in one_to_many)) == len(TEXTS)  # the pair matters
    # classify: one label -> sigmoid of transformers' logits of single texts
    logits = _logits(transformers.BertForSequenceClassification, path, TEXTS)
    torch.testing.assert_close(_probs(llm.classify(TEXTS, use_tqdm=False)), torch.sigmoid(logits), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="At least one text element"):
        llm.score(QUERY, [], use_tqdm=False)
    with pytest.raises(ValueError, match="same length"):
        llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="does not serve the 'embed' pooling task"):
        llm.embed(TEXTS[0], use_tqdm=False)
    check_block_accounting(llm)


def test_roberta_classifier_softmax_over_labels(tmp_path):
    path = make_encoder(tmp_path / "roberta", "RobertaForSequenceClassification", seed=4, num_labels=3)
    logits = _logits(transformers.RobertaForSequenceClassification, path, TEXTS)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    outputs = llm.classify(TEXTS, use_tqdm=False)
    assert outputs[0].outputs.num_classes == 3
    torch.testing.assert_close(_probs(outputs), torch.softmax(logits, dim=-1), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="num_labels == 1"):
        llm.score(QUERY, TEXTS, use_tqdm=False)
    check_block_accounting(llm)


@pytest.fixture(scope="module")
def qwen3_classifier(tiny_qwen3, tmp_path_factory):
    """A Qwen3ForSequenceClassification (2 labels) that transformers writes from the tiny Qwen3,
    its score head given weights of std 1 / sqrt(hidden)."""
    out = tmp_path_factory.mktemp("qwen3-seq-cls")
    model = transformers.Qwen3ForSequenceClassification.from_pretrained(tiny_qwen3, num_labels=2, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=torch.Generator().manual_seed(0))
                                 / model.config.hidden_size ** 0.5)
    model.config.pad_token_id = 0
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_qwen3 / name, out / name)
    return out


def test_qwen3_sequence_classification_equals_transformers(qwen3_classifier, tmp_path):
    """The last token's score head, prompts cut into 8-token chunks; the same checkpoint named
    Qwen3ForCausalLM with --convert classify gives the same probabilities."""
    probs = torch.softmax(_logits(transformers.Qwen3ForSequenceClassification, qwen3_classifier, TEXTS), dim=-1)
    llm = LLM(str(qwen3_classifier), dtype="float32", max_num_batched_tokens=8, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.model_config.pooler_config.pooling_type == "LAST"
    torch.testing.assert_close(_probs(llm.classify(TEXTS, use_tqdm=False)), probs, atol=1e-4, rtol=1e-4)
    check_block_accounting(llm)
    del llm
    causal = tmp_path / "causal"
    shutil.copytree(qwen3_classifier, causal)
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    llm = LLM(str(causal), dtype="float32", convert="classify", kv_cache_memory_bytes=16 << 20)
    torch.testing.assert_close(_probs(llm.classify(TEXTS, use_tqdm=False)), probs, atol=1e-4, rtol=1e-4)
    check_block_accounting(llm)


def test_bi_encoder_score_is_cosine_of_sentence_transformers_embeddings(tmp_path):
    from sentence_transformers import SentenceTransformer

    path = make_sentence_transformer(make_encoder(tmp_path / "raw", "BertModel", seed=3), tmp_path / "st", "mean")
    embeddings = SentenceTransformer(str(path), device="cpu").encode([QUERY, *TEXTS], convert_to_tensor=True).float()
    reference = torch.nn.functional.cosine_similarity(embeddings[:1], embeddings[1:])
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20)
    outputs = llm.score(QUERY, TEXTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outputs], dtype=torch.float32),
                               reference, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not serve the 'classify' pooling task"):
        llm.classify(TEXTS, use_tqdm=False)
    check_block_accounting(llm)


def test_convert_classify_from_two_tokens_is_their_logit_difference(tiny_qwen3):
    """``classifier_from_token`` [false, true] (vLLM's from_2_way_softmax): the probability is
    the sigmoid of the true token's logit less the false token's, of transformers' causal LM."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_qwen3)
    false_id, true_id = 300, 301
    tokens = tokenizer.convert_ids_to_tokens([false_id, true_id])
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.stack([model(**tokenizer(t, return_tensors="pt")).logits[0, -1] for t in TEXTS])
    probs = torch.sigmoid(logits[:, true_id] - logits[:, false_id])
    llm = LLM(str(tiny_qwen3), dtype="float32", convert="classify", hf_overrides={"classifier_from_token": tokens},
              kv_cache_memory_bytes=16 << 20)
    torch.testing.assert_close(_probs(llm.classify(TEXTS, use_tqdm=False))[:, 0], probs, atol=1e-4, rtol=1e-4)
    pair_ids = tokenizer(QUERY + TEXTS[1])["input_ids"]  # an LLM as reranker: the texts joined (vLLM's use_pad_token)
    with torch.no_grad():
        pair_logits = model(torch.tensor([pair_ids])).logits[0, -1]
    score = llm.score(QUERY, TEXTS[1], use_tqdm=False)[0]
    assert score.prompt_token_ids == pair_ids
    assert score.outputs.score == pytest.approx(torch.sigmoid(pair_logits[true_id] - pair_logits[false_id]).item(),
                                                abs=1e-4)
    check_block_accounting(llm)


def test_qwen3_reranker_scores_are_the_model_cards_p_yes(tiny_qwen3, tmp_path):
    """Served as vLLM serves Qwen3-Reranker (``RERANKER_OVERRIDES``), the prompt built by the
    score template or by the caller's prefix / suffix (vLLM's example: the texts are joined),
    the score is the model card's p(yes) on the model card's token ids."""
    path = make_qwen3_reranker(tiny_qwen3, tmp_path / "reranker")
    reference = card_scores(path, QUERY, TEXTS)
    llm = LLM(str(path), runner="pooling", hf_overrides=RERANKER_OVERRIDES, dtype="float32",
              kv_cache_memory_bytes=16 << 20)
    templated = llm.score(QUERY, TEXTS, use_tqdm=False, chat_template=QWEN3_RERANKER_TEMPLATE)
    formatted = llm.score(card_query(QUERY), [card_document(t) for t in TEXTS], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for outputs in (templated, formatted):
        assert [o.prompt_token_ids for o in outputs] == [card_token_ids(tokenizer, QUERY, t) for t in TEXTS]
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in outputs]), reference, atol=1e-5, rtol=1e-4)
    assert len(set(round(o.outputs.score, 5) for o in templated)) == len(TEXTS)
    check_block_accounting(llm)
