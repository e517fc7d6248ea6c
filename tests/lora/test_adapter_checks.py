"""A bad adapter is refused with a clear error naming the thing (``pagedllm.lora.peft_config``),
through ``LLM.generate`` too, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.peft_config import check_adapter, read_adapter_config
from pagedllm.lora.request import LoRARequest
from pagedllm.benchmarks.lora_adapters import make_random_adapter, write_adapter
from tests.helpers import check_block_accounting

A_Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def hf_config(tiny_llama):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama)  # hidden 64, 4 heads of 16, 2 KV heads, 2 layers


def _q_adapter(tmp_path, r=4, out=64, layer=0, **config):
    tensors = {A_Q.replace("layers.0", f"layers.{layer}"): torch.zeros(r, 64),
               B_Q.replace("layers.0", f"layers.{layer}"): torch.zeros(out, r)}
    return write_adapter(tmp_path / "a", {"r": r, "target_modules": ["q_proj"], **config}, tensors)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias 'all'"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"\['embed_tokens'\] are not in this model"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ],
)
def test_unsupported_options_are_refused(tmp_path, hf_config, config, message):
    path = _q_adapter(tmp_path, **config)
    with pytest.raises(ValueError, match=message):
        check_adapter(str(path), hf_config, 16)


def test_rank_shape_layer_and_tensor_errors(tmp_path, hf_config):
    with pytest.raises(ValueError, match="rank 32 is greater than max_lora_rank 16"):
        check_adapter(str(_q_adapter(tmp_path / "r", r=32)), hf_config, 16)
    with pytest.raises(ValueError, match=r"shape \[48, 4\], but this base model needs \[64, 4\]"):
        check_adapter(str(_q_adapter(tmp_path / "s", out=48)), hf_config, 16)
    with pytest.raises(ValueError, match="layer 5, but the model has 2 layers"):
        check_adapter(str(_q_adapter(tmp_path / "l", layer=5)), hf_config, 16)
    path = write_adapter(tmp_path / "e", {"r": 4, "target_modules": ["q_proj"]},
                         {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 1024)})
    with pytest.raises(ValueError, match="lora_embedding_A' is not supported"):
        check_adapter(str(path), hf_config, 16)


def test_missing_adapter(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json not found"):
        read_adapter_config(str(tmp_path / "nowhere"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(FileNotFoundError, match="neither adapter_model.safetensors nor adapter_model.bin"):
        read_adapter_config(str(tmp_path))


def test_scaling_and_rslora(tmp_path):
    plain = read_adapter_config(str(_q_adapter(tmp_path / "p", r=4, lora_alpha=8)))
    rs = read_adapter_config(str(_q_adapter(tmp_path / "q", r=4, lora_alpha=8, use_rslora=True)))
    assert plain.scaling == 2.0 and rs.scaling == 4.0


def test_llm_refuses_bad_requests_and_keeps_serving(tiny_llama, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    base_llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20)
    good = make_random_adapter(str(tiny_llama), tmp_path / "good", rank=8)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        base_llm.generate(prompt, params, lora_request=LoRARequest("x", 1, str(good)), use_tqdm=False)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 is greater than max_lora_rank 4"):
        llm.generate(prompt, params, lora_request=LoRARequest("x", 1, str(good)), use_tqdm=False)
    with pytest.raises(FileNotFoundError):
        llm.generate(prompt, params, lora_request=LoRARequest("y", 2, str(tmp_path / "nope")), use_tqdm=False)
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompt, params, lora_request=[None, None], use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        base_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("z", 0, str(good))
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_adapter_gone_before_it_runs_aborts_only_its_request(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_lora=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    path = make_random_adapter(str(tiny_llama), tmp_path / "gone", rank=4)
    engine.add_request("gone", {"prompt_token_ids": [5, 6, 7]}, params, lora_request=LoRARequest("gone", 1, str(path)))
    engine.add_request("base", {"prompt_token_ids": [5, 6, 7]}, params)
    shutil.rmtree(path)  # checked by the front end, deleted before the worker reads it
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["gone"].outputs[0].finish_reason == "abort"
    assert finished["base"].outputs[0].finish_reason == "length" and len(finished["base"].outputs[0].token_ids) == 4
    check_block_accounting(llm)
