"""A prefill / decode split in one process (``--kv-transfer-config``, ``TCPConnector``): a
request prefilled by a producer engine and finished by a consumer engine, which loads the
prompt's KV over TCP, gives what one engine gives (greedy tokens identical, logprobs close,
seeded sampling identical), whatever the consumer's block size; both engines' block
accounting ends clean; a consumer whose producer is gone, or no longer holds the KV, fails
the request with a clear error, and one whose KV layout differs (the handshake) fails each
request at once, naming the field with both values, not retryable."""

from __future__ import annotations

import logging

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, KVTransferConfig
from pagedllm.distributed import get_open_port
from tests.helpers import check_block_accounting, model_runner, random_prompts

KV_BYTES = 8 << 20
#: One token, a part block, several blocks, and one past the producer's token budget
#: (chunked prefill there): block size 16.
PROMPT_LENGTHS = [1, 7, 16, 33, 70]
NUM_TOKENS = 6
#: The consumer's wait for a producer (seconds): what a dead producer costs the test.
TIMEOUT_S = 3


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """(producer, consumer, one plain engine) of the tiny Llama, float32."""
    common = dict(dtype="float32", kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False)
    prefill = LLM(str(tiny_llama), **common, max_num_batched_tokens=48,
                  kv_transfer_config={"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                                      "kv_port": get_open_port()})
    decode = LLM(str(tiny_llama), **common, role="decode",
                 kv_transfer_config={"kv_connector_extra_config": {"timeout_s": TIMEOUT_S}})
    single = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES)
    return prefill, decode, single


def _prefill(prefill: LLM, prompts: list[list[int]]) -> list[dict]:
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    outputs = prefill.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.kv_transfer_params for o in outputs]


def _with_params(params: SamplingParams, kv_params: dict | None) -> SamplingParams:
    return SamplingParams(**{f: getattr(params, f) for f in ("temperature", "seed", "max_tokens", "logprobs",
                                                             "ignore_eos")},
                          extra_args={"kv_transfer_params": kv_params} if kv_params else None)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_split_equals_one_engine(engines, sampling):
    prefill, decode, single = engines
    prompts = random_prompts(PROMPT_LENGTHS, 1024, seed=3)
    params = (SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=3, ignore_eos=True)
              if sampling == "greedy" else
              SamplingParams(temperature=0.9, seed=11, max_tokens=NUM_TOKENS, logprobs=3, ignore_eos=True))
    expected = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv_params = _prefill(prefill, prompts)
    assert kv_params[0] is None  # a one-token prompt has no KV to send: the consumer computes it
    assert [p["remote_num_tokens"] for p in kv_params[1:]] == [n - 1 for n in PROMPT_LENGTHS[1:]]
    check_block_accounting(prefill)  # blocks freed as the prefills finished; the KV waits in host memory
    actual = decode.generate([{"prompt_token_ids": p} for p in prompts],
                             [_with_params(params, kv) for kv in kv_params], use_tqdm=False)
    for got, want in zip(actual, expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_pos, want_pos in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert list(got_pos) == list(want_pos)
            assert all(abs(got_pos[t].logprob - want_pos[t].logprob) < 1e-4 for t in want_pos)
    assert not model_runner(prefill).kv_connector._buffer  # each prefill's KV was fetched once
    check_block_accounting(decode)
    check_block_accounting(prefill)


def test_a_load_that_fails_aborts_the_request_with_the_reason(engines):
    prefill, decode, _ = engines
    [prompt] = random_prompts([40], 1024, seed=5)
    [kv_params] = _prefill(prefill, [prompt])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    decode.generate([{"prompt_token_ids": prompt}], _with_params(params, kv_params), use_tqdm=False)
    gone = {**kv_params, "remote_port": get_open_port()}  # nobody listens there: a producer that died
    again, dead = decode.generate([{"prompt_token_ids": prompt}] * 2,
                                  [_with_params(params, kv) for kv in (kv_params, gone)], use_tqdm=False)
    assert again.outputs[0].finish_reason == "abort" and again.outputs[0].token_ids == []
    assert "no KV kept for request" in again.kv_transfer_params["error"]
    assert dead.outputs[0].finish_reason == "abort"
    assert f":{gone['remote_port']} did not answer in {TIMEOUT_S} s" in dead.kv_transfer_params["error"]
    check_block_accounting(decode)
    # The engine keeps serving.
    [ok] = decode.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 4 and ok.kv_transfer_params is None


def test_prefix_caching_or_a_draft_model_with_a_role_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="enable_prefix_caching is not supported yet with kv_transfer_config"):
        EngineArgs(model=str(tiny_llama), role="prefill")
    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        EngineArgs(model=str(tiny_llama), kv_transfer_config={"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="draft model or EAGLE head is not supported yet with kv_transfer_config"):
        EngineArgs(model=str(tiny_llama), role="decode", enable_prefix_caching=False,
                   speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="data_parallel_size > 1 is not supported yet with kv_transfer_config"):
        EngineArgs(model=str(tiny_llama), role="prefill", enable_prefix_caching=False, data_parallel_size=2,
                   usage_context="api_server")


@pytest.mark.parametrize("config, role, message", [
    ({"kv_connector": "NixlConnector"}, None, "kv_connector 'NixlConnector' is not supported yet"),
    ({"kv_role": "kv_consumer"}, "prefill", "--role prefill means kv_role 'kv_producer'"),
    ({"kv_port": 0}, None, "kv_port must be a TCP port"),
    ({"kv_buffer_size": 1}, None, r"unknown key\(s\) \['kv_buffer_size'\]"),
    ({"kv_connector_extra_config": {"timeout_s": 0}}, None, r"\['timeout_s'\] must be a positive number"),
])  # fmt: skip
def test_bad_kv_transfer_config_is_refused(config, role, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_args(config, role)


def test_role_alone_sets_the_kv_role():
    config = KVTransferConfig.from_args(None, "decode")
    assert (config.kv_connector, config.kv_role, config.is_kv_consumer, config.is_kv_producer) == (
        "TCPConnector", "kv_consumer", True, False)
    assert KVTransferConfig.from_args(None, None) is None


def test_a_model_with_sliding_windows_is_refused_before_loading(checkpoint_factory):
    path = checkpoint_factory("MistralForCausalLM", sliding_window=16, seed=3)
    with pytest.raises(ValueError, match="kv_transfer_config is not supported yet for MistralForCausalLM"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, role="decode")


def test_a_consumer_of_another_block_size_loads_the_kv(engines, tiny_llama):
    """Block size is not part of the layout the two engines must share: KV moves token by
    token (``block_copy``)."""
    prefill, _, single = engines
    decode = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False,
                 role="decode", block_size=32,
                 kv_transfer_config={"kv_connector_extra_config": {"timeout_s": TIMEOUT_S}})
    prompts = random_prompts([7, 40], 1024, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    actual = decode.generate([{"prompt_token_ids": p} for p in prompts],
                             [_with_params(params, kv) for kv in _prefill(prefill, prompts)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in expected]
    assert all(o.outputs[0].finish_reason == "length" and o.num_cached_tokens == len(p) - 1
               for o, p in zip(actual, prompts))
    check_block_accounting(decode)


def test_a_consumer_of_another_layout_fails_its_requests_naming_the_field(engines, tiny_llama, caplog):
    """A decode engine with an FP8 KV cache (and another block size) next to a float32
    producer: the handshake names kv_cache_dtype with both values, on both sides' logs, and
    every request fails at once, not retryable; the engine keeps serving."""
    prefill, _, _ = engines
    decode = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False,
                 role="decode", block_size=32, kv_cache_dtype="fp8",
                 kv_transfer_config={"kv_connector_extra_config": {"timeout_s": TIMEOUT_S}})
    prompts = random_prompts([20, 33], 1024, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kv_params = _prefill(prefill, prompts)
    with caplog.at_level(logging.ERROR, logger="pagedllm"):
        outputs = decode.generate([{"prompt_token_ids": p} for p in prompts],
                                  [_with_params(params, kv) for kv in kv_params], use_tqdm=False)
    address = f"tcp://127.0.0.1:{kv_params[0]['remote_port']}"
    for output in outputs:
        assert output.outputs[0].finish_reason == "abort" and output.outputs[0].token_ids == []
        error = output.kv_transfer_params["error"]
        assert error.startswith("KV layout mismatch: kv_cache_dtype is float8_e4m3fn on this decode instance "
                                f"(rank 0), float32 on the prefill instance at {address}.")
        assert "block_size" not in error and output.kv_transfer_params["retryable"] is False
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV layout mismatch")]
    assert any("float8_e4m3fn on this decode instance" in m for m in logged)  # the consumer's log
    assert any("float32 on this prefill instance (rank 0" in m and "float8_e4m3fn on a decode instance" in m
               for m in logged)  # the producer's
    check_block_accounting(decode)
    [ok] = decode.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 4
    # The producer kept the KV nobody could fetch; a consumer that matches still gets it.
    _, matching, single = engines
    [want] = single.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    [got] = matching.generate([{"prompt_token_ids": prompts[0]}], _with_params(params, kv_params[0]), use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids



def test_a_consumer_rank_the_producer_lacks_names_tensor_parallel_size(engines, monkeypatch):
    """Rank 1 of a -tp 2 decode engine next to a -tp 1 producer, which has no port for rank 1:
    the rank asks the producer's rank 0 for its layout, so its load fails at once naming
    tensor_parallel_size instead of waiting timeout_s for an answer that cannot come."""
    from types import SimpleNamespace

    from pagedllm.distributed.kv_transfer import tcp_connector
    from pagedllm.distributed.kv_transfer.layout import KVLayout
    from pagedllm.messages.kv_transfer import KVLoadSpec

    prefill, _, _ = engines
    [kv] = _prefill(prefill, random_prompts([20], 1024, seed=13))
    monkeypatch.setattr(tcp_connector, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0, world_size=1))
    monkeypatch.setattr(tcp_connector, "get_tp_group", lambda: SimpleNamespace(rank_in_group=1, world_size=2))
    worker = tcp_connector.TCPConnectorWorker(KVTransferConfig(kv_role="kv_consumer",
                                                               kv_connector_extra_config={"timeout_s": 30}))
    try:
        layout = KVLayout(model="LlamaForCausalLM", num_layers=2, num_kv_heads=1, head_size=16,
                          kv_cache_dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=1, block_size=16)
        worker.register_kv_caches([], layout)
        load = KVLoadSpec(req_id="r", remote_host=kv["remote_host"], remote_port=kv["remote_port"],
                          remote_request_id=kv["remote_request_id"], block_ids=[0, 1], num_tokens=19)
        [error] = worker.start_load_kv(SimpleNamespace(loads=[load])).values()
    finally:
        worker.shutdown()
    assert error.startswith("KV layout mismatch:"), error
    assert "tensor_parallel_size is 2 on this decode instance (rank 1), 1 on the prefill instance" in error
