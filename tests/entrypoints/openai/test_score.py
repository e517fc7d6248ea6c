"""``POST /classify``, ``/v1/score`` and ``/v1/rerank`` of a real ``pagedllm serve`` of a BERT
CrossEncoder folder (one label), by raw HTTP: scores equal sentence-transformers'
``CrossEncoder.predict``, probabilities transformers' sigmoid of its logits; 1:N and N:N
pairs, both field names, ranking, ``top_n`` and ``return_documents``; bad input is a 400 in
OpenAI's error JSON. A Qwen3-Reranker (a Qwen3ForCausalLM with vLLM's ``--hf-overrides``, its
prompt by ``--chat-template``) reranks by its model card's p(yes). (The bi-encoder score of
an embedding model: test_embeddings.py.)"""

from __future__ import annotations

from typing import Iterator

import json

import pytest
import torch

from tests.fixtures.encoders import TEXTS, make_cross_encoder
from tests.models.rerankers import QWEN3_RERANKER_TEMPLATE, RERANKER_OVERRIDES, card_scores, make_qwen3_reranker
from tests.server_utils import RemoteServer

QUERY = "the dog is fast"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return make_cross_encoder(tmp_path_factory.mktemp("ce-server") / "ce", seed=5)


@pytest.fixture(scope="module")
def reference(cross_encoder) -> tuple[torch.Tensor, torch.Tensor]:
    """(CrossEncoder scores of (QUERY, text) per text [4], transformers' sigmoid of each text's logit [4])."""
    import transformers
    from sentence_transformers import CrossEncoder

    scores = torch.tensor(CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, t) for t in TEXTS]))
    model = transformers.BertForSequenceClassification.from_pretrained(cross_encoder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    with torch.no_grad():
        probs = torch.stack([torch.sigmoid(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in TEXTS])
    return scores, probs


@pytest.fixture(scope="module")
def score_server(cross_encoder) -> Iterator[RemoteServer]:
    remote = RemoteServer(cross_encoder, "--served-model-name", "tiny-ce")
    try:
        yield remote
    finally:
        remote.close()


def _ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _close(got: list[float], ref: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), ref.float(), atol=1e-4, rtol=1e-4)


def test_classify_score_and_rerank_equal_the_references(score_server, reference):
    scores, probs = reference
    body = _ok(score_server.post("/classify", json={"model": "tiny-ce", "input": TEXTS}))
    assert body["object"] == "list" and body["model"] == "tiny-ce" and body["id"].startswith("classify-")
    assert [(d["index"], d["num_classes"], d["label"]) for d in body["data"]] == [(i, 1, "LABEL_0") for i in range(4)]
    _close([d["probs"][0] for d in body["data"]], probs)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    one = _ok(score_server.post("/classify", json={"input": TEXTS[1]}))
    _close(one["data"][0]["probs"], probs[1:2])

    one_to_many = _ok(score_server.post("/v1/score", json={"text_1": QUERY, "text_2": TEXTS}))
    assert [d["object"] for d in one_to_many["data"]] == ["score"] * 4
    _close([d["score"] for d in one_to_many["data"]], scores)
    many = _ok(score_server.post("/score", json={"queries": [QUERY] * 2, "documents": TEXTS[2:]}))
    _close([d["score"] for d in many["data"]], scores[2:])
    single = _ok(score_server.post("/v1/score", json={"text_1": QUERY, "text_2": TEXTS[3]}))
    _close([single["data"][0]["score"]], scores[3:])

    ranked = _ok(score_server.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 3}))
    order = torch.argsort(scores, descending=True)[:3].tolist()
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[i] for i in order]
    _close([r["relevance_score"] for r in ranked["results"]], scores[order])
    assert ranked["usage"]["total_tokens"] == one_to_many["usage"]["total_tokens"]
    bare = _ok(score_server.post("/rerank", json={"query": QUERY, "documents": TEXTS, "return_documents": False}))
    assert len(bare["results"]) == 4 and all(r["document"] is None for r in bare["results"])


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_bad_score_requests_are_openai_errors(score_server):
    error = _error(score_server.post("/v1/rerank", json={"query": QUERY, "documents": []}))
    assert error["type"] == "invalid_request_error" and "At least one text element" in error["message"]
    error = _error(score_server.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]}))
    assert "same length" in error["message"]
    _error(score_server.post("/v1/score", json={"text_1": QUERY}))
    error = _error(score_server.post("/v1/score", json={"text_1": QUERY, "text_2": "a " * 80}))
    assert error["code"] == "context_length_exceeded"
    cut = _ok(score_server.post("/v1/score", json={"text_1": QUERY, "text_2": "a " * 80, "truncate_prompt_tokens": 20}))
    assert cut["usage"]["prompt_tokens"] == 20
    _error(score_server.post("/classify", json={"input": []}))
    error = _error(score_server.post("/v1/embeddings", json={"input": "hello"}))
    assert "does not serve the 'embed' pooling task" in error["message"]
    _error(score_server.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": -1}))
    assert score_server.health_ok()


@pytest.fixture(scope="module")
def reranker(tiny_qwen3, tmp_path_factory) -> Iterator[tuple[RemoteServer, torch.Tensor]]:
    """(a server of the tiny Qwen3-Reranker with its score template, the model card's scores of
    (QUERY, text) per text [4])."""
    out = tmp_path_factory.mktemp("qwen3-reranker")
    (out / "qwen3_reranker.jinja").write_text(QWEN3_RERANKER_TEMPLATE)
    path = make_qwen3_reranker(tiny_qwen3, out / "model")
    remote = RemoteServer(path, "--runner", "pooling", "--hf-overrides", json.dumps(RERANKER_OVERRIDES),
                          "--chat-template", str(out / "qwen3_reranker.jinja"), "--served-model-name", "tiny-reranker")
    try:
        yield remote, card_scores(path, QUERY, TEXTS)
    finally:
        remote.close()


def test_qwen3_reranker_reranks_by_the_model_cards_p_yes(reranker):
    remote, reference = reranker
    ranked = _ok(remote.post("/v1/rerank", json={"model": "tiny-reranker", "query": QUERY, "documents": TEXTS}))
    order = torch.argsort(reference, descending=True).tolist()
    assert [r["index"] for r in ranked["results"]] == order
    _close([r["relevance_score"] for r in ranked["results"]], reference[order])
    scored = _ok(remote.post("/v1/score", json={"text_1": QUERY, "text_2": TEXTS[1]}))
    _close([scored["data"][0]["score"]], reference[1:2])
