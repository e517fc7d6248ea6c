"""``-tp 2`` on the architectures whose tensor-parallel split differs from the Llama family's:
Gemma 3 (per-head q/k norms, local and global ropes), GLM-4 (partial rotary in interleaved
pairs), Phi-3 (fused q/k/v and gate/up checkpoint tensors split per rank), DeepSeek-V3 (MLA's
heads and its grouped router). Greedy tokens equal transformers' (float32) under chunked
prefill on two worker processes; one engine per architecture.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import can_host_workers, check_block_accounting
from tests.models import test_deepseek, test_gemma3
from tests.models.utils import prompts_for, transformers_greedy

pytestmark = pytest.mark.skipif(not can_host_workers(2), reason="needs 2 cores (CPU) or 2 GPUs (CUDA)")

MAX_TOKENS = 6
ARCHS = {
    "gemma3": ("Gemma3ForCausalLM", dict(test_gemma3.GEMMA3_CONFIG, seed=73, tie_word_embeddings=True)),
    "glm4": ("Glm4ForCausalLM", dict(seed=77, attention_bias=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "phi3": ("Phi3ForCausalLM", dict(seed=75, sliding_window=16)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(test_deepseek.V3, seed=72)),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_two_ranks_equal_transformers(name, checkpoint_factory, tokenizer):
    arch, config = ARCHS[name]
    path = checkpoint_factory(arch, **config)
    prompts = prompts_for(len(tokenizer), (3, 17, 45))
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20, block_size=8,
              max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy(path, prompts, MAX_TOKENS)
        check_block_accounting(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
