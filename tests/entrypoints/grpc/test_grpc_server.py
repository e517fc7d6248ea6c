"""``pagedllm serve --grpc``: the ``pagedllm.v1.Generation`` service against a real server
(one per module), through a grpcio client, beside HTTP on the same engine."""

from __future__ import annotations

import time

import grpc
import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.grpc.stubs import load_stubs
from tests.server_utils import RemoteServer, _free_port

API_KEY = "sk-grpc-test"
MODEL_NAME = "tiny-grpc"
messages, services = load_stubs()
AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def server(tiny_llama):
    port = _free_port()
    remote = RemoteServer(tiny_llama, "--grpc", "--grpc-port", str(port), "--served-model-name", MODEL_NAME, api_key=API_KEY)
    remote.grpc_port = port
    try:
        yield remote
    finally:
        remote.close()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        yield services.GenerationStub(channel)
    finally:
        channel.close()


def _idle_metrics(server, timeout_s: float = 5.0) -> dict[str, float]:
    """/metrics once no request runs or waits (the gauges follow the engine's next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        busy = metrics.get("pagedllm:num_requests_running", 0) + metrics.get("pagedllm:num_requests_waiting", 0)
        if not busy or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def _generate(stub, **fields):
    params = messages.SamplingParams(**fields.pop("sampling", {}))
    return list(stub.Generate(messages.GenerateRequest(sampling_params=params, **fields), metadata=AUTH, timeout=60))


def test_generate_streams_the_http_completion(server, stub):
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    replies = _generate(stub, text="The capital of France is", sampling=sampling)
    http = server.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
    }).json()  # fmt: skip
    choice = http["choices"][0]
    assert len(replies) > 1 and all(not r.finished for r in replies[:-1]) and replies[-1].finished
    assert "".join(r.text for r in replies) == choice["text"]
    http_ids = [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]
    assert [t for r in replies for t in r.token_ids] == http_ids
    last = replies[-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == (
        "length", 8, http["usage"]["prompt_tokens"]
    )
    assert last.request_id.startswith("grpc-") and {r.request_id for r in replies} == {last.request_id}
    # token-id prompts and a named request: the same tokens
    prompt_ids = messages.TokenIds(ids=server.post("/tokenize", json={"model": MODEL_NAME, "prompt": "The capital of France is"}).json()["tokens"])
    again = _generate(stub, request_id="mine-1", token_ids=prompt_ids, sampling=sampling)
    assert [t for r in again for t in r.token_ids] == http_ids and again[-1].request_id == "mine-1"
    assert _idle_metrics(server)["pagedllm:kv_cache_usage_perc"] == 0.0


def test_abort_and_cancel_free_the_request(server, stub):
    before = _idle_metrics(server)
    request = messages.GenerateRequest(
        request_id="to-abort", text="Count:", sampling_params=messages.SamplingParams(max_tokens=1500, ignore_eos=True)
    )
    stream = stub.Generate(request, metadata=AUTH, timeout=120)
    first = next(stream)
    assert first.request_id == "to-abort" and not first.finished
    assert server.metrics()["pagedllm:num_requests_running"] == 1
    assert stub.Abort(messages.AbortRequest(request_ids=["to-abort", "unknown"]), metadata=AUTH).aborted == ["to-abort"]
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and rest[-1].completion_tokens < 1500
    # a cancelled call aborts its request too
    call = stub.Generate(messages.GenerateRequest(text="Count:", sampling_params=request.sampling_params), metadata=AUTH)
    next(call)
    call.cancel()
    after = _idle_metrics(server)
    assert after["pagedllm:num_requests_running"] == 0 and after["pagedllm:num_requests_waiting"] == 0
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0
    aborted = "pagedllm:request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0.0) == 2


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"text": "Hi", "sampling": {"temperature": -1.0}}, "temperature must be non-negative"),
        ({"text": "Hi", "sampling": {"top_p": 0.0}}, "top_p"),
        ({"text": "Hi", "sampling": {"max_tokens": 0}}, "max_tokens must be at least 1"),
        ({"sampling": {}}, "prompt: set text or token_ids"),
        ({"token_ids": messages.TokenIds(ids=[10**7])}, "token"),
    ],
)
def test_bad_params_are_invalid_argument(stub, fields, reason):
    with pytest.raises(grpc.RpcError) as error:
        _generate(stub, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in error.value.details()


def test_health_model_info_and_api_key(server, stub):
    assert stub.Health(messages.HealthRequest(), timeout=10).healthy  # open, as /health
    info = stub.ModelInfo(messages.ModelInfoRequest(), metadata=AUTH, timeout=10)
    http_model = server.get("/v1/models").json()["data"][0]
    assert list(info.served_model_names) == [MODEL_NAME] == [http_model["id"]]
    assert info.max_model_len == http_model["max_model_len"] and info.vocab_size > 0
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfo(messages.ModelInfoRequest(), metadata=metadata, timeout=10)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_flags():
    args = build_parser().parse_args(["serve"])
    assert (args.grpc, args.grpc_port) == (False, 50051)
    args = build_parser().parse_args(["serve", "--grpc", "--grpc-port", "6000"])
    assert (args.grpc, args.grpc_port) == (True, 6000)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--grpc-port", "70000"])


def test_stubs_are_generated_once_into_the_cache(tmp_path, monkeypatch):
    from pagedllm.entrypoints.grpc import stubs

    monkeypatch.setattr(stubs, "CACHE_DIR", tmp_path / "cache")
    directory = stubs.stubs_dir()
    assert directory == tmp_path / "cache" / stubs.stubs_key()
    generated = {path.name: path.stat().st_mtime_ns for path in directory.iterdir()}
    assert {"pagedllm_generation_pb2.py", "pagedllm_generation_pb2_grpc.py"} <= set(generated)
    assert stubs.stubs_dir() == directory and {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == generated
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [directory.name]  # no staging left behind
