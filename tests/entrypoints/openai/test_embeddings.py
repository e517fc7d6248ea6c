"""``POST /v1/embeddings`` of a real ``pagedllm serve`` of a BERT sentence-transformers folder
(MEAN + Normalize), declared Matryoshka by ``--hf-overrides``: the openai SDK's
``client.embeddings.create`` (float and base64, list and token-id inputs, ``dimensions``)
equals sentence-transformers' ``encode``, and LangChain's ``OpenAIEmbeddings`` the server's vectors; bad input is a 400 in OpenAI's error JSON; a
generative model has no such route (404) and a pooling model no completions (400)."""

from __future__ import annotations

import json
from typing import Iterator

import pytest
import torch

from tests.fixtures.encoders import TEXTS, make_encoder, make_sentence_transformer
from tests.server_utils import RemoteServer

MATRYOSHKA_DIMENSIONS = [16, 64]


@pytest.fixture(scope="module")
def bert_st(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert-st-server")
    return make_sentence_transformer(make_encoder(tmp / "raw", "BertModel", seed=2), tmp / "st", "mean", normalize=True)


@pytest.fixture(scope="module")
def reference(bert_st) -> torch.Tensor:
    """sentence-transformers' normalized embeddings of ``TEXTS`` [4, 64] float32."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bert_st), device="cpu").encode(TEXTS, convert_to_tensor=True).float()


@pytest.fixture(scope="module")
def embedding_server(bert_st) -> Iterator[RemoteServer]:
    overrides = json.dumps({"matryoshka_dimensions": MATRYOSHKA_DIMENSIONS})
    remote = RemoteServer(bert_st, "--served-model-name", "tiny-bert", "--hf-overrides", overrides)
    try:
        yield remote
    finally:
        remote.close()


def _close(got, ref: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor([list(g) for g in got], dtype=torch.float32), ref, atol=1e-4, rtol=1e-4)


def test_sdk_embeddings_equal_sentence_transformers(embedding_server, reference):
    client = embedding_server.client()
    as_base64 = client.embeddings.create(model="tiny-bert", input=TEXTS)  # the SDK asks for base64 and decodes it
    as_float = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float", user="u-1")
    for response in (as_base64, as_float):
        assert response.object == "list" and response.model == "tiny-bert"
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        _close([d.embedding for d in response.data], reference)
    token_ids = [embedding_server.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(len(ids) for ids in token_ids)
    by_ids = client.embeddings.create(model="tiny-bert", input=token_ids, encoding_format="float")
    _close([d.embedding for d in by_ids.data], reference)
    one = client.embeddings.create(model="tiny-bert", input=token_ids[1], encoding_format="float")
    _close([one.data[0].embedding], reference[1:2])
    cut = client.embeddings.create(model="tiny-bert", input=TEXTS[:2], dimensions=16, encoding_format="float")
    _close([d.embedding for d in cut.data], torch.nn.functional.normalize(reference[:2, :16], dim=-1))


def test_langchain_openai_embeddings_equal_the_servers_vectors(embedding_server, reference):
    """LangChain's ``OpenAIEmbeddings`` (token counting off: the server's tokenizer is not
    tiktoken's) on the server: ``embed_documents`` / ``embed_query`` equal ``/v1/embeddings``'."""
    from langchain_openai import OpenAIEmbeddings

    served = embedding_server.post("/v1/embeddings", json={"model": "tiny-bert", "input": TEXTS})
    assert served.status_code == 200, served.text
    vectors = torch.tensor([d["embedding"] for d in served.json()["data"]], dtype=torch.float32)
    _close(vectors, reference)
    embeddings = OpenAIEmbeddings(model="tiny-bert", base_url=f"{embedding_server.url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False)
    _close(embeddings.embed_documents(TEXTS), vectors)
    _close([embeddings.embed_query(TEXTS[2])], vectors[2:3])


def test_bi_encoder_score_and_rerank_are_cosines_of_the_embeddings(embedding_server, reference):
    """An embedding model scores a pair by the cosine of its two embeddings."""
    cosines = reference[1:] @ reference[0]
    scored = embedding_server.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert scored.status_code == 200, scored.text
    _close([[d["score"] for d in scored.json()["data"]]], cosines[None])
    ranked = embedding_server.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}).json()
    assert [r["index"] for r in ranked["results"]] == torch.argsort(cosines, descending=True)[:2].tolist()
    error = _error(embedding_server.post("/classify", json={"input": "hello"}), 400)
    assert "does not serve the 'classify' pooling task" in error["message"]


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_bad_embedding_requests_are_openai_errors(embedding_server, server):
    error = _error(embedding_server.post("/v1/embeddings", json={"input": "hello", "dimensions": 10}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == "dimensions"
    assert "matryoshka_dimensions [16, 64]" in error["message"]
    error = _error(embedding_server.post("/v1/embeddings", json={"input": ["hello world"] * 2 + ["a " * 80]}), 400)
    assert error["code"] == "context_length_exceeded" and "maximum context length is 64 tokens" in error["message"]
    truncated = embedding_server.post("/v1/embeddings", json={"input": "a " * 80, "truncate_prompt_tokens": 10})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 10
    _error(embedding_server.post("/v1/embeddings", json={"input": []}), 400)
    _error(embedding_server.post("/v1/embeddings", json={"input": "a", "encoding_format": "int8"}), 400)
    _error(embedding_server.post("/v1/embeddings", json={"input": "a", "model": "no-such-model"}), 404)
    error = _error(embedding_server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}), 400)
    assert "is a pooling model" in error["message"]
    error = _error(server.post("/v1/embeddings", json={"input": "hello"}), 404)
    assert error["message"] == "Invalid URL (POST /v1/embeddings)"
    assert embedding_server.health_ok()
