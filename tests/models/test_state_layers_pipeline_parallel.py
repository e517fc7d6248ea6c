"""``-pp 2`` on state-space and hybrid models (one worker process per stage, hidden states and
the residual passed on by gloo send / recv, two micro-batches in flight): Mamba-2, Bamba
(Mamba-2 mixers and attention), Qwen3-Next (Gated DeltaNet, gated attention, experts) and
Nemotron-H (Mamba-2, attention, MLP and expert layers; a stage of cacheless layers only) give
transformers' greedy tokens (float32), as one process does, with prompts cut into 16-token
chunks beside decodes, requests preempted for lack of attention blocks (the hybrids), and a
prompt's second run starting from the state its first saved (a prefix-cache hit); each run
ends with the block-accounting check. Each stage holds only its layers, their state tensors (the same slot
ids, the scheduler's, on both stages) and the KV caches of its attention layers; a stage with no
attention layer sizes no attention block.

Starting workers takes a while, so each model's engine starts once.
"""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.model_executor.layers.mamba.abstract import MambaBase
from pagedllm.worker.kv_cache_sizing import NO_BLOCK_LIMIT
from tests.engine.test_pipeline_parallel import needs_two_workers
from tests.helpers import check_block_accounting
from tests.models import test_qwen3_next
from tests.models.utils import prompts_for, transformers_greedy

pytestmark = needs_two_workers

MAX_TOKENS = 8
#: Past the 16-token SSD chunks; the last two share 40 tokens (prefix hits across requests).
PROMPT_LENGTHS = (1, 20, 45, 90, 90)
#: 16-token steps; prefix caching; 20 blocks of 8 tokens for the ~45 the hybrids' batch needs.
ENGINE_KWARGS = dict(dtype="float32", block_size=8, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128,
                     kv_cache_memory_bytes=16 << 20, num_gpu_blocks_override=20, enable_prefix_caching=True)

#: architecture -> (checkpoint config, each stage's expected contents: ``_stage_contents``).
MODELS = {
    "Mamba2ForCausalLM": (
        dict(seed=5, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4,
             chunk_size=16, expand=2),
        [{"state_layers": [0], "state_tensors": 2, "kv_caches": 0, "embed": True, "head": False},
         {"state_layers": [1], "state_tensors": 2, "kv_caches": 0, "embed": False, "head": True}],
    ),
    "BambaForCausalLM": (
        dict(seed=6, num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
             mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=2),
        [{"state_layers": [0], "state_tensors": 2, "kv_caches": 1, "embed": True, "head": False},
         {"state_layers": [2, 3], "state_tensors": 4, "kv_caches": 0, "embed": False, "head": True}],
    ),
    "Qwen3NextForCausalLM": (  # linear attention on layers 0 .. 2, gated attention on 3
        dict(test_qwen3_next.CONFIG, seed=7),
        [{"state_layers": [0, 1], "state_tensors": 4, "kv_caches": 0, "embed": True, "head": False},
         {"state_layers": [2], "state_tensors": 2, "kv_caches": 1, "embed": False, "head": True}],
    ),
    "NemotronHForCausalLM": (  # Mamba-2, routed experts, attention | MLP, routed experts
        dict(seed=9, hybrid_override_pattern="ME*-E", head_dim=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
             ssm_state_size=16, conv_kernel=4, chunk_size=16, intermediate_size=128, n_routed_experts=8,
             num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
             moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True),
        [{"state_layers": [0], "state_tensors": 2, "kv_caches": 1, "embed": True, "head": False},
         {"state_layers": [], "state_tensors": 0, "kv_caches": 0, "embed": False, "head": True}],
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def pp2(request, checkpoint_factory):
    """(architecture, checkpoint, its -pp 2 engine)."""
    path = checkpoint_factory(request.param, **MODELS[request.param][0])
    llm = LLM(str(path), pipeline_parallel_size=2, **ENGINE_KWARGS)
    yield request.param, path, llm
    llm.llm_engine.engine_core.shutdown()


def _greedy(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_equals_transformers_with_chunks_preemption_and_prefix_hits(pp2, tokenizer):
    """The prompts in one batch (16-token chunks beside decodes; the hybrids preempted), then
    each of the 90-token prompts twice alone: the second run starts from the state its first
    saved at token 88 (a preempted request saves its state past its prompt, where no fresh
    run of it can hit), with the KV blocks before it."""
    arch, path, llm = pp2
    core = llm.llm_engine.engine_core
    assert isinstance(core.model_executor, MultiprocExecutor)
    prompts = prompts_for(len(tokenizer), PROMPT_LENGTHS)
    expected = transformers_greedy(path, prompts, MAX_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == expected
    if any(stage["kv_caches"] for stage in MODELS[arch][1]):
        assert core.scheduler.num_preemptions > 0, "the hybrid was not preempted"
    assert core.batch_queue.max_batches_in_flight == 2
    for i in (3, 4):
        runs = [_greedy(llm, [prompts[i]])[0] for _ in range(2)]
        assert [list(run.outputs[0].token_ids) for run in runs] == [expected[i]] * 2
        assert runs[1].num_cached_tokens == 88, "the second run did not start from the saved state"
    check_block_accounting(llm)


def _stage_contents(worker) -> dict:
    runner = worker.model_runner
    model = runner.model
    state_layers = sorted(int(re.search(r"layers\.(\d+)\.", f"{name}.")[1])
                          for name, m in model.named_modules() if isinstance(m, MambaBase))
    names = {name for name, _ in model.named_parameters()}
    return {
        "state_layers": state_layers,
        "state_tensors": len(runner.state_caches),
        "slots": {t.shape[0] for t in runner.state_caches},
        "kv_caches": len(runner.kv_caches),
        "embed": any(".embed" in n for n in names),
        "head": "lm_head.weight" in names,
        "blocks_sized": worker.determine_num_available_blocks(),
    }


def test_each_stage_holds_its_layers_states_and_kv_caches(pp2):
    """Each stage's state layers and their tensors (the slots of ``max_num_seqs`` x 3 with
    prefix caching, one id space for both stages), its attention layers' KV caches, its end
    of the model; a stage without attention sizes no attention block (``NO_BLOCK_LIMIT``; the
    other stage's size decides), one with attention a finite number."""
    arch, _, llm = pp2
    contents = llm.llm_engine.engine_core.model_executor.collective_rpc(_stage_contents)
    slots = ENGINE_KWARGS["max_num_seqs"] * 3
    hybrid = any(stage["kv_caches"] for stage in MODELS[arch][1])
    for stage, expected in zip(contents, MODELS[arch][1]):
        assert {k: stage[k] for k in expected} == expected
        assert stage["slots"] == ({slots} if expected["state_tensors"] else set())
        if not hybrid:  # no attention anywhere: no attention block at all
            assert stage["blocks_sized"] == 0
        elif expected["kv_caches"]:
            assert 0 < stage["blocks_sized"] < NO_BLOCK_LIMIT
        else:
            assert stage["blocks_sized"] == NO_BLOCK_LIMIT
