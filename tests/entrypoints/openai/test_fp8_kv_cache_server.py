"""``pagedllm serve --kv-cache-dtype fp8``: completions through the official client give the
offline engine's tokens on the same FP8 cache, and /metrics names the cache dtype."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from tests.server_utils import RemoteServer


def test_server_with_fp8_kv_cache(tiny_llama):
    prompt = list(range(20, 45))
    offline = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_bytes=16 << 20, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text
    del offline
    server = RemoteServer(tiny_llama, "--kv-cache-dtype", "fp8")
    try:
        reply = server.client().completions.create(
            model=str(tiny_llama), prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text == expected and reply.usage.completion_tokens == 8
        info = [k for k in server.metrics() if k.startswith("pagedllm:cache_config_info{")]
        assert len(info) == 1 and "cache_dtype=fp8_e4m3" in info[0], info
    finally:
        server.close()
