"""``pagedllm serve`` starts its engine process before it imports torch (start-up time,
see ``pagedllm/entrypoints/openai/cli_args.py``): the modules on that path must stay
free of torch and transformers (and of the grammar libraries, xgrammar and llguidance, and of
Ray, imported only by the Ray executor)."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT_MODULES = [
    "pagedllm",
    "pagedllm.entrypoints.cli",
    "pagedllm.entrypoints.openai.cli_args",
    "pagedllm.config",
    "pagedllm.engine.client_factory",
    "pagedllm.engine.core_client",
    "pagedllm.engine.core_proc",
    "pagedllm.core.scheduler",
    "pagedllm.messages.engine_core",
    "pagedllm.messages.sched_output",
    "pagedllm.messages.runner_output",
    "pagedllm.lora.request",
    "pagedllm.envs",
]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_does_not_import_torch(module):
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'xgrammar', 'llguidance', 'ray') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"importing {module} imported {done.stdout.strip()}"


def test_lazy_public_names_resolve():
    import pagedllm
    from pagedllm.sampling_params import SamplingParams

    assert pagedllm.SamplingParams is SamplingParams
    assert "LLM" in dir(pagedllm)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(pagedllm, "nope")
