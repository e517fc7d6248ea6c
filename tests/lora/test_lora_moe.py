"""LoRA on a mixture-of-experts model (Mixtral): an adapter on the attention layers gives
transformers' greedy output of the PEFT-merged model (base requests in the same batch
unchanged); an adapter on the experts is refused with a message that says so."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.helpers import check_block_accounting, float32_llm, hf_greedy, make_peft_adapter, random_prompts
from tests.models.test_mixtral import CONFIG

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def mixtral(checkpoint_factory):
    return checkpoint_factory("MixtralForCausalLM", seed=3, **CONFIG)


@pytest.fixture(scope="module")
def attention_adapter(mixtral, tmp_path_factory):
    return make_peft_adapter(mixtral, tmp_path_factory.mktemp("moe-lora"), r=4, lora_alpha=8,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)


def _expert_adapter(adapter, out):
    """A copy of ``adapter`` that also adapts expert 0's w1 in layer 0 (as PEFT wrote for
    per-expert linear modules)."""
    shutil.copytree(adapter, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "w1"]
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(out / "adapter_model.safetensors")
    base = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    tensors[f"{base}.lora_A.weight"], tensors[f"{base}.lora_B.weight"] = torch.zeros(4, 64), torch.zeros(32, 4)
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def test_attention_lora_on_moe_model_and_expert_lora_refused(mixtral, attention_adapter, tmp_path):
    adapter, merged = attention_adapter
    prompts = random_prompts([5, 33], 1000, seed=4)
    llm = float32_llm(mixtral, {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("attn", 1, str(adapter))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params,
                           lora_request=[lora] * len(prompts) + [None] * len(prompts), use_tqdm=False)
    expected = [hf_greedy(merged, p, MAX_TOKENS) for p in prompts] + [hf_greedy(mixtral, p, MAX_TOKENS) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert expected[0] != expected[len(prompts)]  # the adapter changes the output
    check_block_accounting(llm)

    experts = _expert_adapter(adapter, tmp_path / "experts")
    with pytest.raises(ValueError, match=r"\['w1'\] are not in this model; .*LoRA on mixture-of-experts experts \(FusedMoE\) is not"):
        llm.generate([{"prompt_token_ids": prompts[0]}], params, lora_request=LoRARequest("experts", 2, str(experts)))
    config = json.loads((experts / "adapter_config.json").read_text())
    (experts / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.lora_A\.weight' adapts an expert: LoRA on mixture-of-experts experts"):
        llm.generate([{"prompt_token_ids": prompts[0]}], params, lora_request=LoRARequest("experts2", 3, str(experts)))
    check_block_accounting(llm)
