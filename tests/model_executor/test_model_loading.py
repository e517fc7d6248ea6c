"""Loading checkpoints: sharded files, the local HF cache, dtypes, bad architectures, and
the KV budget check."""

from __future__ import annotations

import json
import logging
import shutil

import huggingface_hub
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.kv_cache_sizing import kv_bytes_per_token
from tests.helpers import cpu_only, hf_greedy, model_runner, random_prompts


def greedy(n=8):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_sharded_checkpoint_loads(checkpoint_factory, tokenizer):
    path = checkpoint_factory("LlamaForCausalLM", seed=7, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    prompt = random_prompts([20], len(tokenizer), seed=3)[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)


def test_model_id_from_the_local_hf_cache(tiny_llama, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_llama, snapshot)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1
    llm = LLM("acme/tiny", dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert llm.generate([5, 6, 7], greedy(), use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(tiny_llama, [5, 6, 7], 8)
    with pytest.raises(ValueError, match="not a local directory and not in the Hugging Face cache .*, and HF_HUB_OFFLINE is set"):
        LLM("acme/missing", kv_cache_memory_bytes=4 << 20)


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("auto", torch.bfloat16)])
def test_dtypes(tiny_llama, dtype, torch_dtype):
    llm = LLM(str(tiny_llama), dtype=dtype, kv_cache_memory_bytes=4 << 20)
    runner = model_runner(llm)
    assert runner.kv_caches[0].dtype == torch_dtype
    assert next(runner.model.parameters()).dtype == torch_dtype
    out = llm.generate([5, 6, 7], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # Low precision may flip near-ties late in the sequence, but the first token agrees.
    assert out[0] == hf_greedy(tiny_llama, [5, 6, 7], 1)[0]


def test_unknown_dtype(tiny_llama):
    with pytest.raises(ValueError, match="Unknown dtype 'int3'"):
        LLM(str(tiny_llama), dtype="int3", kv_cache_memory_bytes=4 << 20)


@pytest.mark.parametrize("trust_remote_code", [False, True])  # remote code adds no architecture
def test_unknown_architecture_lists_supported_ones(tiny_llama, tmp_path, trust_remote_code):
    path = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForTokenClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForTokenClassification' is not supported yet.*Supported architectures: .*LlamaForCausalLM, .*MistralForCausalLM, .*Qwen2ForCausalLM, .*Qwen3ForCausalLM"):
        LLM(str(path), kv_cache_memory_bytes=4 << 20, trust_remote_code=trust_remote_code)


def test_kv_budget_too_small_explains_the_formula(tiny_llama):
    # 2 layers x 2 KV heads x head_dim 16 x 4 bytes x 2 = 512 bytes per token; 2048 tokens need 1 MiB.
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=512 * 1000)
    message = str(info.value)
    assert "max_model_len = 2048" in message
    assert "2 x num_layers (2) x num_kv_heads (2) x head_dim (16) x dtype bytes (4) = 512" in message
    assert "holds 62 blocks" in message and "128 blocks" in message
    assert "Lower max_model_len" in message
    assert LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=512 * 1000, max_model_len=992)


def test_budget_from_memory_utilization_logs_blocks_and_concurrency(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        logging.getLogger("pagedllm").propagate = True
        try:
            llm = LLM(str(tiny_llama), dtype="float32", gpu_memory_utilization=0.01, max_model_len=512)
        finally:
            logging.getLogger("pagedllm").propagate = False
    num_blocks = llm.llm_engine.engine_core.num_gpu_blocks
    assert num_blocks >= 32
    assert any(f"KV cache: {num_blocks} blocks" in r.message and "maximum concurrency for 512 tokens per request" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("block_size", [4, 64])
def test_unsupported_block_size(tiny_llama, block_size):
    with pytest.raises(ValueError, match=r"block_size must be one of \(8, 16, 32\)"):
        LLM(str(tiny_llama), block_size=block_size)


def test_max_model_len_above_the_model_maximum(tiny_llama):
    with pytest.raises(ValueError, match=r"max_model_len \(4096\) is larger than the model's maximum context length \(2048"):
        LLM(str(tiny_llama), max_model_len=4096)


def _kv_log(tiny_llama, caplog, monkeypatch, env: dict, **kwargs):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        logging.getLogger("pagedllm").propagate = True
        try:
            llm = LLM(str(tiny_llama), dtype="float32", **kwargs)
        finally:
            logging.getLogger("pagedllm").propagate = False
    line = [r.message for r in caplog.records if r.message.startswith("KV cache:")][-1]
    config = llm.llm_engine.config
    return llm.llm_engine.engine_core.num_gpu_blocks, line, kv_bytes_per_token(config.model_config) * 16


@cpu_only
@pytest.mark.parametrize("prefix_caching, factor", [(True, 2), (False, 1)])
def test_cpu_default_kv_cache_is_what_the_configuration_can_use(tiny_llama, caplog, monkeypatch, prefix_caching, factor):
    """On CPU a small model does not reserve most of the RAM: the default budget is
    max_num_seqs x max_model_len tokens (twice that with prefix caching)."""
    num_blocks, line, _ = _kv_log(
        tiny_llama, caplog, monkeypatch, {}, max_num_seqs=4, max_model_len=512, enable_prefix_caching=prefix_caching
    )
    assert num_blocks == 4 * 512 * factor // 16
    assert "Budget from what the configuration can use: " + f"{4 * 512 * factor:,} tokens" in line


@cpu_only
@pytest.mark.parametrize("name", ["PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"])
def test_cpu_kvcache_space_env_in_gib(tiny_llama, caplog, monkeypatch, name):
    num_blocks, line, per_block = _kv_log(tiny_llama, caplog, monkeypatch, {name: "0.01"}, max_model_len=512)
    assert num_blocks == int(0.01 * 2**30) // per_block
    assert f"Budget from {name}=0.01 GiB = {int(0.01 * 2**30):,}." in line
    # The argument wins over the environment.
    num_blocks, line, _ = _kv_log(
        tiny_llama, caplog, monkeypatch, {name: "0.01"}, max_model_len=512, kv_cache_memory_bytes=4 << 20
    )
    assert num_blocks == (4 << 20) // per_block


@cpu_only
def test_bad_cpu_kvcache_space_env(tiny_llama, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE must be a number of GiB, got 'lots'"):
        LLM(str(tiny_llama))
