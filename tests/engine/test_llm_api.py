"""The offline API end to end: input forms, bad input, sampling reproducibility, stop
strings, min_tokens, n > 1, chat, LLMEngine stepping and aborts, memory efficiency."""

from __future__ import annotations

import pytest

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.config import EngineArgs
from tests.helpers import check_block_accounting, kv_block_bytes, random_prompts

KV_BYTES = 16 << 20


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=512)


def greedy(max_tokens=16, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_prompt_forms_give_the_same_output(llm):
    text = "The quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    by_text = llm.generate(text, greedy(), use_tqdm=False)
    by_ids = llm.generate(ids, greedy(), use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], greedy(), use_tqdm=False)
    by_one_dict = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)
    by_keyword = llm.generate(sampling_params=greedy(), prompt_token_ids=[ids, ids[:2]], use_tqdm=False)
    by_flat_keyword = llm.generate(sampling_params=greedy(), prompt_token_ids=ids, use_tqdm=False)
    with_text = llm.generate(text, greedy(), prompt_token_ids=ids, use_tqdm=False)
    assert by_text[0].prompt == text and by_text[0].prompt_token_ids == ids
    expected = by_text[0].outputs[0].token_ids
    assert len(expected) == 16
    for out in (by_ids[0], by_dict[0], by_dict[1], by_one_dict[0], by_keyword[0], by_flat_keyword[0], with_text[0]):
        assert out.outputs[0].token_ids == expected
    assert len(by_keyword) == 2 and by_keyword[1].prompt_token_ids == ids[:2]
    assert with_text[0].prompt == text
    with pytest.raises(ValueError, match="pair up"):
        llm.generate([text, text], greedy(), prompt_token_ids=[ids], use_tqdm=False)
    with pytest.raises(ValueError, match="needs prompts"):
        llm.generate(sampling_params=greedy(), use_tqdm=False)
    assert by_text[0].outputs[0].text == llm.get_tokenizer().decode(expected)
    check_block_accounting(llm)


def test_outputs_in_input_order_with_per_prompt_params(llm, tokenizer):
    prompts = random_prompts([50, 2, 30, 9], len(tokenizer), seed=5)
    params = [greedy(max_tokens=m) for m in (3, 9, 1, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1, 5]
    assert [o.prompt_token_ids for o in outs] == prompts
    with pytest.raises(ValueError, match="2 SamplingParams for 4 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params[:2], use_tqdm=False)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], greedy(), "prompt is empty"),
        ("", greedy(), "prompt is empty"),
        ("hi \ud800", greedy(), r"lone UTF-16 surrogate \(\\ud800\)"),
        ({"prompt": "\udfff"}, greedy(), "lone UTF-16 surrogate"),
        ([5, 1024, 7], greedy(), r"Token id 1024 is out of vocabulary.*\[0, 1024\)"),
        ([-1], greedy(), "out of vocabulary"),
        ([5] * 600, greedy(), "600 tokens long.*maximum context length is 512"),
        ([5] * 500, greedy(max_tokens=20), r"maximum context length is 512 tokens.*520 tokens \(500 in the prompt, 20 for the completion\)"),
    ],
)
def test_bad_prompt_raises_and_other_requests_finish(tiny_llama, prompt, params, message):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=512)
    )
    engine.add_request("good-1", [10, 11, 12], greedy(max_tokens=4))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    engine.add_request("good-2", [13, 14], greedy(max_tokens=4))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["good-1", "good-2"]
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished.values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 129}, "n must be"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"best_of": 3}, r"best_of is not supported \(it must be unset or equal to n\); got best_of=3, n=1"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"bad_words": ["ok", " "]}, "bad_words must be a list of non-blank strings"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_with_a_bad_prompt_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[5, 6], [99999]], greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    check_block_accounting(llm)
    assert len(llm.generate([[5, 6]], greedy(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_seeded_request_is_independent_of_the_batch(llm, tokenizer):
    target = {"prompt_token_ids": [20, 21, 22, 23]}
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts([7, 40, 3], len(tokenizer), seed=9)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mix1 = llm.generate([others[0], target, others[1]], [unseeded, params, unseeded], use_tqdm=False)
    mix2 = llm.generate([target] + others, [params, unseeded, greedy(), unseeded], use_tqdm=False)
    assert mix1[1].outputs[0].token_ids == alone
    assert mix2[0].outputs[0].token_ids == alone
    other_seed = llm.generate(target, SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm):
    prompt = {"prompt_token_ids": [30, 31, 32]}
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert sampled[0].outputs[0].token_ids == llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids


def test_n_3_with_seed_is_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [40, 41]}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": [40, 41]}, params, use_tqdm=False)[0]
    completions = [tuple(c.token_ids) for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len(set(completions)) == 3
    assert completions == [tuple(c.token_ids) for c in second.outputs]
    check_block_accounting(llm)


def _find_stop_cases(llm):
    """A greedy completion and a stop string spanning two tokens and ending inside a third,
    as (prompt, full text, stop string, its position in the text)."""
    tok = llm.get_tokenizer()
    for seed in range(30):
        prompt = random_prompts([6], len(tok), seed=100 + seed)[0]
        out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=24), use_tqdm=False)[0].outputs[0]
        # Character offset where each token's text starts (prefix decodes).
        starts = [len(tok.decode(out.token_ids[:i])) for i in range(len(out.token_ids) + 1)]
        for i in range(1, len(out.token_ids) - 3):
            if starts[i + 3] - starts[i + 2] < 2 or starts[i + 1] == starts[i]:
                continue
            stop = out.text[starts[i] : starts[i + 2] + 1]
            if "\ufffd" not in stop and out.text.find(stop) == starts[i] and stop.strip():
                return prompt, out.text, stop, starts[i]
    pytest.fail("no suitable greedy completion found for the stop-string test")


def test_stop_strings_across_and_inside_tokens(llm):
    prompt, full_text, stop, position = _find_stop_cases(llm)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full_text[:position]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        {"prompt_token_ids": prompt},
        greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full_text[: position + len(stop)]
    check_block_accounting(llm)


def test_min_tokens_suppresses_stop_strings_and_eos(llm):
    prompt, full_text, stop, position = _find_stop_cases(llm)
    out = llm.generate(
        {"prompt_token_ids": prompt}, greedy(max_tokens=24, stop=[stop], min_tokens=24), use_tqdm=False
    )[0].outputs[0]
    assert out.text == full_text and out.finish_reason == "length"
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logit_bias={eos: 100.0})
    forced = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) == 8 and eos not in forced.token_ids[:7]
    stopped = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0}), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"


def test_stop_token_ids_give_stop_reason(llm):
    base = llm.generate({"prompt_token_ids": [50, 51]}, greedy(max_tokens=10), use_tqdm=False)[0].outputs[0]
    target = base.token_ids[4]
    out = llm.generate({"prompt_token_ids": [50, 51]}, greedy(max_tokens=10, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(target)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_no_replacement_characters_unless_the_full_decode_has_them(llm):
    tok = llm.get_tokenizer()
    for seed in range(6):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        out = llm.generate("日本語のテキスト 🙂🚀 emoji", params, use_tqdm=False)[0].outputs[0]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, greedy(max_tokens=5), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected_prompt
    assert expected_prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(expected_prompt, add_special_tokens=False)
    two = llm.chat([messages, [{"role": "user", "content": "Bye"}]], greedy(max_tokens=3), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids[:3]


def test_chat_takes_text_parts_and_vllms_positional_order(llm, tokenizer):
    """vLLM's ``LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template,
    chat_template_content_format, ...)``, and OpenAI's text parts: as a list to the test
    tokenizer's template, which loops over them ("auto"), or joined with newlines ("string")."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = llm.chat([{"role": "user", "content": parts}], greedy(max_tokens=4), False, None)[0]
    assert as_parts.prompt == tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                                            add_generation_prompt=True)
    assert "Hellothere" in as_parts.prompt
    as_string = llm.chat([{"role": "user", "content": "Hello\nthere"}], greedy(max_tokens=4), False)[0]
    joined = llm.chat([{"role": "user", "content": parts}], greedy(max_tokens=4), False, None, None, "string")[0]
    assert joined.prompt == as_string.prompt and joined.outputs[0].token_ids == as_string.outputs[0].token_ids
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        llm.chat([{"role": "user", "content": parts}], greedy(max_tokens=4), chat_template_content_format="list")
    image = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: an image_url part, but this model is text-only"):
        llm.chat([{"role": "user", "content": image}], greedy(max_tokens=4), use_tqdm=False)


def test_engine_abort_frees_blocks(tiny_llama):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=512)
    )
    engine.add_request("a", [1, 2, 3], greedy(max_tokens=200))
    engine.add_request("b", [4, 5, 6], SamplingParams(n=2, max_tokens=200, ignore_eos=True))
    engine.add_request("c", [7, 8], greedy(max_tokens=10))
    for _ in range(3):
        engine.step()
    engine.abort_request(["a", "b"])
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.request_id for o in outputs if o.finished] == ["c"]
    pool = engine.engine_core.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_paged_cache_runs_4x_more_sequences_than_contiguous(tiny_llama, tokenizer):
    max_model_len = 2048
    probe = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=max_model_len)
    per_block = kv_block_bytes(probe)
    del probe
    blocks_per_max_len_seq = max_model_len // 16
    budget = 2 * blocks_per_max_len_seq * per_block  # contiguous pre-allocation fits 2 sequences
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=budget, max_model_len=max_model_len)
    )
    for i, prompt in enumerate(random_prompts([20] * 32, len(tokenizer), seed=3)):
        engine.add_request(str(i), prompt, greedy(max_tokens=20))
    core = engine.engine_core
    while engine.has_unfinished_requests():
        engine.step()
        for request in core.scheduler.running:
            held = len(core.kv_cache_manager.get_blocks(request.request_id).blocks[0])
            assert held == -(-request.num_computed_tokens // 16), "more than one partial block held"
    assert core.scheduler.max_num_running_observed >= 4 * 2
    core.kv_cache_manager.block_pool.check_integrity()


def test_vllm_keywords_are_accepted(tiny_llama):
    """vLLM's engine keywords: built ones act (an exact block count, a logprobs limit named
    in the error), no-ops are taken, and the values here (1, "auto", None) are accepted."""
    llm = LLM(
        str(tiny_llama), dtype="float32", max_model_len=256, num_gpu_blocks_override=20, max_logprobs=2,
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, distributed_executor_backend="uni",
        trust_remote_code=True, enforce_eager=True, swap_space=8, max_seq_len_to_capture=1024,
        disable_custom_all_reduce=True, disable_sliding_window=True, enable_chunked_prefill=True,
        load_format="safetensors", kv_cache_dtype="auto", tokenizer_mode="auto", quantization=None,
    )  # fmt: skip
    assert llm.llm_engine.engine_core.num_gpu_blocks == 20
    assert llm.llm_engine.engine_core.kv_cache_manager.block_pool.num_blocks == 20
    (out,) = llm.generate([5, 6, 7], greedy(max_tokens=3, logprobs=2, prompt_logprobs=2), use_tqdm=False)
    assert len(out.outputs[0].logprobs) == 3 and all(len(position) >= 2 for position in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match="Requested sample logprobs of 3, which is greater than max allowed: 2"):
        llm.generate([5, 6, 7], greedy(logprobs=3), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 5, which is greater than max allowed: 2"):
        llm.generate([5, 6, 7], greedy(prompt_logprobs=5), use_tqdm=False)
    check_block_accounting(llm)


def test_size_keywords_take_the_cli_spellings(tiny_llama):
    """``max_model_len``, ``kv_cache_memory_bytes`` and ``max_num_batched_tokens`` take the
    strings their flags take ("1K", "1M", "auto"), as the same numbers; a bad one names its keyword."""
    by_string = LLM(str(tiny_llama), dtype="float32", max_model_len="256", kv_cache_memory_bytes="1M",
                    max_num_batched_tokens="1K")
    core = by_string.llm_engine.engine_core
    assert by_string.llm_engine.model_config.max_model_len == 256
    assert core.num_gpu_blocks == LLM(str(tiny_llama), dtype="float32", max_model_len=256,
                                      kv_cache_memory_bytes=1 << 20).llm_engine.engine_core.num_gpu_blocks
    assert core.scheduler.max_num_batched_tokens == 1024
    (out,) = by_string.generate([5, 6, 7], greedy(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    check_block_accounting(by_string)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: invalid value 'lots'"):
        LLM(str(tiny_llama), kv_cache_memory_bytes="lots")
    with pytest.raises(ValueError, match="max_model_len: invalid value '1.5x'"):
        LLM(str(tiny_llama), max_model_len="1.5x")


def test_more_logprobs_than_openai_when_max_logprobs_allows(llm, tiny_llama):
    """The limit is the engine's ``max_logprobs`` (20 by default), not a fixed 20."""
    with pytest.raises(ValueError, match="greater than max allowed: 20"):
        llm.generate([5, 6], greedy(max_tokens=1, logprobs=21), use_tqdm=False)
    wide = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 20, max_logprobs=-1)
    (out,) = wide.generate([5, 6], greedy(max_tokens=1, logprobs=50), use_tqdm=False)
    assert len(out.outputs[0].logprobs[0]) >= 50


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size 3 does not divide the model's num_attention_heads 4"),
        ({"tensor_parallel_size": 8}, "tensor_parallel_size 8 does not divide the model's num_attention_heads 4"),
        ({"pipeline_parallel_size": 4}, "pipeline_parallel_size 4 exceeds the model's num_hidden_layers 2"),
        ({"data_parallel_size": 2}, r"data_parallel_size=2 is not supported yet offline \(LLM runs one engine core\); "
                                    r"serve the replicas behind one API server: pagedllm serve MODEL -dp 2\."),
        ({"data_parallel_size": 0}, "data_parallel_size must be at least 1, got 0."),
        ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend='external_launcher' is not supported yet"),
        ({"load_format": "pt"}, "load_format='pt' is not supported yet"),
        ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype='fp8_inc' is not supported yet"),
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral' is not supported yet"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not supported yet"),
        ({"enable_lora": True, "max_loras": 0}, "max_loras must be at least 1"),
        ({"quantization": "awq"}, "--quantization awq needs a checkpoint quantized as awq .* int8, int4, fp8"),
        ({"quantization": "bitsandbytes"}, "Quantization method 'bitsandbytes' is not supported yet. Supported: awq, "),
        ({"max_logprobs": -2}, "max_logprobs must be -1"),
        ({"num_gpu_blocks_override": 3}, "num_gpu_blocks_override=3 cannot hold one sequence"),
    ],
)
def test_values_not_built_fail_before_the_model_loads(tiny_llama, kwargs, message, monkeypatch):
    import pagedllm.model_executor.model_loader as model_loader

    monkeypatch.setattr(model_loader, "iterate_weights", lambda *_: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), dtype="float32", max_model_len=256, **kwargs)


def test_unknown_keyword_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_paralel_size'; did you mean 'tensor_parallel_size'"):
        LLM(tensor_paralel_size=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'usage_context'"):
        LLM(usage_context="api_server")



def _banned_by_bad_words(words: list[list[int]], output: list[int]) -> set[int]:
    """The reference rule (vLLM's ``bad_words``): a word's last token is banned when the
    output ends with its other tokens."""
    return {word[-1] for word in words if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]}


def test_bad_words_match_a_step_by_step_reference(llm):
    """Each step of a bad-words request equals one greedy step of the same text with the
    banned tokens' logits pushed down by ``logit_bias`` (an independent path)."""
    prompt = "The quick brown fox"
    base = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    one_token = tokenizer.decode(base[:1])  # banned from the first step
    two_tokens = tokenizer.decode(base[5:7])  # its second token is banned after the first
    for bad_words, first_change in (([one_token], 0), ([two_tokens], 6)):
        params = greedy(bad_words=bad_words)
        params.update_from_tokenizer(tokenizer)
        words = params.bad_words_token_ids
        assert [base[first_change]] in [w[-1:] for w in words]
        output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert output[:first_change] == base[:first_change] and output[first_change] != base[first_change]
        expected: list[int] = []
        ids = tokenizer.encode(prompt)
        for _ in range(16):
            bias = {t: -100.0 for t in _banned_by_bad_words(words, expected)}
            step = llm.generate({"prompt_token_ids": ids + expected}, greedy(max_tokens=1, logit_bias=bias), use_tqdm=False)
            expected.append(step[0].outputs[0].token_ids[0])
        assert output == expected


def test_allowed_token_ids(llm, tokenizer):
    prompt = "The quick brown fox"
    base = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # every greedy choice allowed: the output is unchanged
    kept = llm.generate(prompt, greedy(allowed_token_ids=sorted(set(base)) + [7]), use_tqdm=False)
    assert kept[0].outputs[0].token_ids == base
    # none of them allowed: only the listed ids come out; one id: only it
    others = [t for t in range(20, 40) if t not in base]
    restricted = llm.generate(prompt, greedy(allowed_token_ids=others), use_tqdm=False)[0].outputs[0].token_ids
    assert set(restricted) <= set(others) and len(restricted) == 16
    sampled = llm.generate(prompt, SamplingParams(max_tokens=16, seed=3, allowed_token_ids=others), use_tqdm=False)
    assert set(sampled[0].outputs[0].token_ids) <= set(others)
    single = llm.generate(prompt, greedy(max_tokens=4, allowed_token_ids=[9]), use_tqdm=False)
    assert single[0].outputs[0].token_ids == [9, 9, 9, 9]
    with pytest.raises(ValueError, match=r"allowed_token_ids has token id 1024, outside \[0, 1024\)"):
        llm.generate(prompt, greedy(allowed_token_ids=[5, 1024]), use_tqdm=False)
    check_block_accounting(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(100, 140))
    (cut,) = llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=7), use_tqdm=False)
    (short,) = llm.generate({"prompt_token_ids": ids[-7:]}, greedy(), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.outputs[0].token_ids == short.outputs[0].token_ids
    (whole,) = llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole.prompt_token_ids == ids  # -1: the last max_model_len (512) tokens
    params = greedy(max_tokens=12, truncate_prompt_tokens=500)
    (long,) = llm.generate({"prompt_token_ids": [5] * 600}, params, use_tqdm=False)
    assert long.prompt_token_ids == [5] * 500 and len(long.outputs[0].token_ids) == 12
