"""The checkpoints the project makes itself load in transformers and are fit for greedy tests."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.testing.checkpoints import CHAT_TEMPLATE, build_tokenizer

FIXTURES = ["tiny_llama", "tiny_llama3_rope", "tiny_qwen2", "tiny_qwen3", "tiny_mistral"]
ARCHS = {
    "tiny_llama": "LlamaForCausalLM",
    "tiny_llama3_rope": "LlamaForCausalLM",
    "tiny_qwen2": "Qwen2ForCausalLM",
    "tiny_qwen3": "Qwen3ForCausalLM",
    "tiny_mistral": "MistralForCausalLM",
}
PROMPTS = [
    "The quick brown fox",
    "def main():\n    return 42",
    "你好，世界！😀",
    "<|im_start|>user\nReturn the number of items.<|im_end|>\n<|im_start|>assistant\n",
]
TRICKY_TEXT = (
    "Hello, world! 12345 3.14\n\n\tdef f(x):\n    return x**2  # ok\r\n"
    "你好，世界。こんにちは。안녕하세요. 😀🚀👨‍👩‍👧‍👦 🇯🇵 café naïve I'm we'LL"
)


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def _greedy(model, tok, prompt, n=12):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])
    return new, top2[:, 0] - top2[:, 1]


# ---------------------------------------------------------------------------- tokenizer


def test_special_tokens(tokenizer):
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == tokenizer.bos_token_id == 0
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=True)  # no BOS added
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 2


def test_tokenizer_is_deterministic(tokenizer):
    a = build_tokenizer(cache=False)
    b = build_tokenizer(cache=False)
    assert a.get_vocab() == b.get_vocab() == tokenizer.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_tokenizer_cache_returns_independent_objects():
    a = build_tokenizer()
    b = build_tokenizer()
    assert a is not b
    a.padding_side = "left"
    assert b.padding_side == "right"


def test_round_trip_unicode(tokenizer):
    ids = tokenizer.encode(TRICKY_TEXT)
    assert tokenizer.decode(ids) == TRICKY_TEXT
    # Multi-byte characters are split over several byte-level tokens, so single tokens
    # decode to partial UTF-8 (what incremental detokenization has to cope with).
    for ch in ["😀", "你", "🚀"]:
        pieces = tokenizer.encode(ch)
        assert len(pieces) > 1, ch
        assert tokenizer.decode(pieces) == ch
    assert any("\ufffd" in tokenizer.decode([i]) for i in tokenizer.encode("😀"))


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False).endswith("<|im_end|>\n")


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", FIXTURES)
def test_checkpoint_loads(name, request, tokenizer):
    path = request.getfixturevalue(name)
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (path / f).is_file(), f
    assert (path / "model.safetensors").is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ARCHS[name]]
    assert config["eos_token_id"] == config["pad_token_id"] == config["bos_token_id"] == 0
    assert "rope_theta" in config and "torch_dtype" in config
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE

    model = _load(path)
    assert type(model).__name__ == ARCHS[name]
    assert model.config.vocab_size == len(tokenizer)
    hf_tok = AutoTokenizer.from_pretrained(path)
    assert hf_tok.encode(TRICKY_TEXT) == tokenizer.encode(TRICKY_TEXT)
    assert hf_tok.eos_token_id == 0 and hf_tok.pad_token_id == 0
    assert hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    ) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_outputs_vary(name, request, tokenizer):
    """Random init must not give one repeated token, nor the same output for every prompt,
    and the greedy choice should usually win by a clear margin."""
    model = _load(request.getfixturevalue(name))
    outputs, gaps = [], []
    for prompt in PROMPTS:
        new, gap = _greedy(model, tokenizer, prompt)
        outputs.append(tuple(new))
        gaps.append(gap)
        assert len(set(new)) >= 3, (prompt, new)
    assert len(set(outputs)) == len(PROMPTS)
    gaps = torch.cat(gaps)
    assert gaps.median() > 0.3, gaps


def test_arch_specific_weights(tiny_qwen2, tiny_qwen3, tiny_llama3_rope):
    qwen2 = _load(tiny_qwen2)
    attn = qwen2.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().min() > 0
    assert qwen2.config.tie_word_embeddings
    assert qwen2.lm_head.weight.data_ptr() == qwen2.model.embed_tokens.weight.data_ptr()
    with safe_open(tiny_qwen2 / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()

    qwen3 = _load(tiny_qwen3)
    attn = qwen3.model.layers[0].self_attn
    assert qwen3.config.head_dim == 32 != qwen3.config.hidden_size // qwen3.config.num_attention_heads
    assert attn.q_proj.weight.shape == (4 * 32, 64)
    for norm in (attn.q_norm, attn.k_norm, qwen3.model.norm, qwen3.model.layers[0].input_layernorm):
        assert not torch.allclose(norm.weight, torch.ones_like(norm.weight))

    config = json.loads((tiny_llama3_rope / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_theta"] == 500000.0


def test_sharded_checkpoint(checkpoint_factory, tokenizer):
    kwargs = dict(seed=7, num_hidden_layers=1)
    single = checkpoint_factory("LlamaForCausalLM", **kwargs)
    sharded = checkpoint_factory("LlamaForCausalLM", max_shard_size="100KB", **kwargs)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    ids = torch.tensor([tokenizer.encode(PROMPTS[0])])
    with torch.inference_mode():
        a = _load(single)(ids).logits
        b = _load(sharded)(ids).logits
    assert torch.equal(a, b)


def test_same_arguments_same_weights(checkpoint_factory, tmp_path):
    from pagedllm.testing.checkpoints import make_checkpoint

    first = checkpoint_factory("Qwen3ForCausalLM", seed=11, num_hidden_layers=1)
    second = make_checkpoint(tmp_path / "again", "Qwen3ForCausalLM", seed=11, num_hidden_layers=1)
    with safe_open(first / "model.safetensors", "pt") as f, safe_open(
        second / "model.safetensors", "pt"
    ) as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), g.get_tensor(key)), key


def test_bfloat16_checkpoint(checkpoint_factory):
    path = checkpoint_factory("LlamaForCausalLM", seed=5, dtype=torch.bfloat16)
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
