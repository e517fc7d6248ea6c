"""Helpers shared by tests: HF transformers references and the block-accounting check."""

from __future__ import annotations

import importlib.util
import random
import shutil
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm import LLM
from pagedllm.platforms import current_platform
from pagedllm.worker.model_runner import ModelRunner


#: The checkpoint tensors of the linear layers that quantization formats replace.
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")  # fmt: skip



#: For tests of what only the CPU has (its kernels, its attention backend, its defaults):
#: skipped on a CUDA machine.
cpu_only = pytest.mark.skipif(not current_platform.is_cpu, reason="a CPU-only path")

def as_tensor_parallel_rank(monkeypatch, rank: int, world_size: int) -> None:
    """Make this process see itself as ``rank`` of a tensor-parallel group of ``world_size``
    (layers built now take that rank's part; no collective may run)."""
    from pagedllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_tp_group", parallel_state.GroupCoordinator(list(range(world_size)), rank))


#: Mixtral's per-expert checkpoint matrices (gate, down, up), beside ``LINEAR_SUFFIXES``.
MIXTRAL_EXPERT_SUFFIXES = ("w1.weight", "w2.weight", "w3.weight")


def rewrite_linear_weights(src: Path, out: Path, transform: Callable[[torch.Tensor], torch.Tensor],
                           suffixes: tuple[str, ...] = LINEAR_SUFFIXES) -> Path:
    """A copy of checkpoint ``src`` in ``out`` with each linear weight W (a tensor whose name
    ends with one of ``suffixes``) replaced by ``transform(W.float())`` (in W's dtype): e.g. a
    quantization format's dequantized weights."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.endswith(suffixes):
                tensors[name] = transform(tensor.float()).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@lru_cache(maxsize=8)
def hf_model(path: Path):
    """The checkpoint loaded by transformers in float32 (cached per path)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for one prompt: ``max_new_tokens`` tokens, EOS neither
    stopping it nor suppressed (the engine's ``ignore_eos``; ``min_new_tokens`` would mask EOS
    out of the logits instead)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_token_ids])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_token_ids) :].tolist()


def _greedy_beside_hf(llm: LLM, reference: Path, num_tokens: int, logprobs: int | None = None):
    """(prompt, ``llm``'s completion, transformers' greedy token ids) for three random prompts
    (5, 17 and 40 tokens), ``num_tokens`` greedy tokens each (EOS ignored)."""
    from pagedllm import SamplingParams

    prompts = random_prompts([5, 17, 40], 1000, seed=3)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=logprobs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(prompt, output.outputs[0], hf_greedy(reference, prompt, num_tokens)) for prompt, output in zip(prompts, outputs)]


def assert_greedy_equals_hf(llm: LLM, reference: Path, num_tokens: int = 8) -> None:
    """``llm``'s greedy output (EOS ignored) for three random prompts (5, 17 and 40 tokens) equals
    transformers' on checkpoint ``reference`` (e.g. the dequantized weights of a quantized model)."""
    for _, completion, expected in _greedy_beside_hf(llm, reference, num_tokens):
        assert list(completion.token_ids) == expected


def assert_greedy_close_to_hf(llm: LLM, reference: Path, num_tokens: int = 8, top_k: int = 5) -> None:
    """As ``assert_greedy_equals_hf`` for a model whose greedy output is not defined to float32
    rounding: one that quantizes its activations, where an ulp moves an activation across a
    rounding boundary and the logits by a whole quantization step. (On the random W8A8 test
    checkpoint, transformers' own float32 logits with and without its KV cache differ by up to
    0.5 and pick different tokens at the fifth step of a prompt, where the top two are 0.04
    apart.) The outputs are token-identical up to their first difference; there each side's
    token is among the other's ``top_k`` most likely (vLLM's ``check_logprobs_close``
    criterion for quantized models), and the prompt's comparison stops."""
    for prompt, completion, expected in _greedy_beside_hf(llm, reference, num_tokens, logprobs=top_k):
        got = list(completion.token_ids)
        if got == expected:
            continue
        step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        reference_top = hf_log_softmax(reference, prompt + expected[:step])[-1].topk(top_k).indices.tolist()
        assert got[step] in reference_top and expected[step] in completion.logprobs[step], (
            f"step {step}: {got} vs transformers' {expected}; transformers' top {top_k}: {reference_top}, "
            f"ours: {list(completion.logprobs[step])}"
        )


def hf_log_softmax(path: Path, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 log-softmax of transformers' logits at each position."""
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids >= 3 skip the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def check_block_accounting(llm: LLM, expect_idle: bool = True) -> None:
    """free + in use == total; each block's ref count is the number of block tables (of
    every KV-cache group) that hold it; with no unfinished request, nothing is in use."""
    core = llm.llm_engine.engine_core
    pool = core.kv_cache_manager.block_pool
    pool.check_integrity()
    refs = Counter(b.block_id for manager in core.kv_cache_manager.managers
                   for blocks in manager.req_to_blocks.values() for b in blocks if b is not pool.null_block)
    assert all(pool.blocks[i].ref_cnt == n for i, n in refs.items()), "a block's ref count is not its holders'"
    assert sum(refs.values()) == sum(b.ref_cnt for b in pool.blocks), "a block is referenced by no table"
    if expect_idle:
        assert not core.scheduler.has_unfinished_requests()
        assert pool.get_num_free_blocks() == pool.num_usable_blocks, "blocks still held after all requests finished"
        assert not core.kv_cache_manager.has_requests(), "a request still holds a block table"
    check_state_slot_accounting(core.kv_cache_manager, {r.request_id for r in core.scheduler.running})


def check_state_slot_accounting(manager, running_ids: set[str]) -> None:
    """Each state group's slots: free + in use == total; each running request holds a working
    slot of its own (then, with prefix caching, its hit's slot and a save slot), each slot's
    ref count is the number of requests holding it, and no other request (a finished,
    aborted or preempted one) holds any."""
    for state in manager.state_managers:
        slots = state.block_pool
        slots.check_integrity()
        assert set(state.req_to_blocks) == running_ids, "state slots are not those of the running requests"
        assert all(1 <= len(held) <= 3 for held in state.req_to_blocks.values()), "a request holds no or too many slots"
        refs = Counter(b.block_id for held in state.req_to_blocks.values() for b in held)
        assert all(slots.blocks[i].ref_cnt == n for i, n in refs.items()), "a slot's ref count is not its holders'"
        assert all(refs[held[0].block_id] == 1 for held in state.req_to_blocks.values()), "a working slot is shared"
        assert slots.get_num_free_blocks() == slots.num_usable_blocks - len(refs)


def model_runner(llm: LLM) -> ModelRunner:
    """The ``ModelRunner`` of ``llm``'s one worker (in-process engine, uni executor)."""
    return llm.llm_engine.engine_core.model_executor.driver_worker.model_runner


def kv_block_bytes(llm: LLM) -> int:
    """Bytes of one KV-cache block of ``llm``'s model."""
    return model_runner(llm).kv_cache_bytes_per_token() * llm.llm_engine.config.cache_config.block_size


def state_cache_bytes(llm: LLM) -> int:
    """Bytes of ``llm``'s state slots (0 for a model without state layers)."""
    runner = model_runner(llm)
    return runner.num_state_slots * runner.kv_cache_groups.state_bytes_per_request


def randomize_lora(peft_model, seed: int):
    """``peft_model`` with its LoRA A and B drawn at random (B non-zero, so the adapter
    changes the outputs); returns it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 / param.shape[1] ** 0.5))
    return peft_model


def make_peft_adapter(base: Path, out_dir: Path, *, r: int, lora_alpha: float, target_modules: list[str],
                      use_rslora: bool = False, seed: int = 0, safe_serialization: bool = True) -> tuple[Path, Path]:
    """Write a PEFT LoRA adapter for ``base`` (A and B drawn at random, so it changes the
    outputs) and its merged model; returns (adapter folder, merged checkpoint folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = randomize_lora(get_peft_model(model, config), seed)
    adapter_dir, merged_dir = out_dir / "adapter", out_dir / "merged"
    peft_model.save_pretrained(adapter_dir, safe_serialization=safe_serialization)
    peft_model.merge_and_unload().save_pretrained(merged_dir)
    return adapter_dir, merged_dir


def float32_llm(path, kwargs: dict) -> LLM:
    """An ``LLM`` of ``path`` in float32 with ``kwargs``: 16 MiB of KV cache unless given;
    ``kv_blocks`` in ``kwargs`` sizes the cache in blocks requests can hold instead
    (measured on a probe; one more where a sliding window reserves the null block; the
    state slots of a model with state layers besides)."""
    kwargs = dict(kwargs)
    kv_blocks = kwargs.pop("kv_blocks", None)
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    if kv_blocks is not None:
        probe = LLM(str(path), dtype="float32", **kwargs)
        kv_blocks += probe.llm_engine.engine_core.kv_cache_manager.block_pool.null_block is not None
        kwargs["kv_cache_memory_bytes"] = kv_blocks * kv_block_bytes(probe) + state_cache_bytes(probe)
        del probe
    return LLM(str(path), dtype="float32", **kwargs)


def run_spawned_ranks(target: Callable, world_size: int, timeout_s: float = 120.0) -> dict[int, dict]:
    """Run ``target(rank, init_method, results)`` in ``world_size`` spawned processes joined at
    one ``tcp://127.0.0.1`` address; each puts one dict with its ``"rank"`` on ``results``.
    Returns them by rank once every process exited with code 0 (asserted)."""
    import multiprocessing

    from pagedllm.network import get_open_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{get_open_port()}"
    procs = [context.Process(target=target, args=(r, init_method, results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank = {}
    for _ in procs:
        out = results.get(timeout=timeout_s)
        by_rank[out["rank"]] = out
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return by_rank


def can_host_workers(num_workers: int) -> bool:
    """Whether this machine can run ``num_workers`` worker processes (one core each on CPU,
    one GPU each on CUDA): tensor-parallel tests skip where it cannot."""
    try:
        current_platform.check_worker_count(num_workers)
    except ValueError:
        return False
    return True


def load_training_script():
    """``tools/train_default_model.py`` as a module (it is a script, not a package module)."""
    path = Path(__file__).resolve().parents[1] / "tools" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
