"""Import cost of the start-up path. The ``pagedllm`` command and the modules below it stay
free of torch and transformers (and of the grammar libraries, xgrammar and llguidance, and of
Ray, imported only by the Ray executor): ``pagedllm --help``, the client commands and a
spawned engine process pay only for what they use. ``pagedllm serve`` imports torch and
transformers' config modules once, to resolve the configuration, before it forks the engine
(``pagedllm/entrypoints/openai/cli_args.py``); the HTTP server's modules import nothing of the
model's execution (model code, workers, transformers' modeling modules, gRPC)."""

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


#: What the API server never needs (the engine process imports the model side itself).
NOT_IN_API_SERVER = ("grpc", "ray", "xgrammar", "llguidance", "sympy", "torch.distributed.tensor",
                     "transformers.modeling_utils", "pagedllm.model_executor", "pagedllm.worker",
                     "pagedllm.executor", "pagedllm.attention")


def test_api_server_imports_nothing_of_model_execution():
    code = (
        "import sys, pagedllm.entrypoints.openai.api_server\n"
        f"prefixes = {NOT_IN_API_SERVER!r}\n"
        "found = sorted(m for m in sys.modules if m.startswith(prefixes) and (m in prefixes or\n"
        "               any(m.startswith(p + '.') for p in prefixes)))\n"
        "found += sorted(m for m in sys.modules  # a model's modeling code (auto's name tables are not)\n"
        "               if m.startswith('transformers.models.') and '.modeling_' in m and '.auto.' not in m)\n"
        "print(','.join(found))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"importing the API server imported {done.stdout.strip()}"


#: What ``pagedllm serve`` leaves until it has forked the engine (the front end imports them
#: while the engine loads the model).
NOT_BEFORE_THE_FORK = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")


def test_serve_forks_the_engine_before_importing_the_http_modules(tiny_qwen2):
    """Up to the engine's fork, ``pagedllm serve`` imports only what resolving the
    configuration needs: the HTTP modules come after it, in parallel with the model's load."""
    code = (
        "import os, sys\n"
        "import pagedllm.engine.client_factory as factory\n"
        "def make_client(*args, **kwargs):\n"
        f"    print('found=' + ','.join(sorted(m for m in {NOT_BEFORE_THE_FORK!r} if m in sys.modules)), flush=True)\n"
        "    os._exit(0)\n"
        "factory.make_client = make_client\n"
        "from pagedllm.entrypoints.cli import main\n"
        f"main(['serve', {str(tiny_qwen2)!r}, '--port', '0'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    found = [line for line in done.stdout.splitlines() if line.startswith("found=")]
    assert found, f"pagedllm serve did not reach the engine's fork: {done.stderr[-2000:]}"
    assert found[0] == "found=", f"pagedllm serve imported {found[0][6:]} before forking the engine"


def test_serve_builds_only_its_own_parser():
    code = (
        "import sys\n"
        "from pagedllm.entrypoints.cli import build_parser\n"
        "args = build_parser('serve').parse_args(['serve', '--max-model-len', '1k'])\n"
        "print(args.command, args.max_model_len, 'pagedllm.benchmarks' in sys.modules, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["serve", "1000", "False", "False"]


def test_an_engine_imports_only_the_model_module_it_serves(tiny_qwen2):
    """The model registry imports a model's module when its class is asked for: an engine of
    a Qwen2 checkpoint imports llama.py (and the modules it uses), not the image, encoder or
    state models' modules, nor transformers' activations (whose import pulls
    torch.distributed.tensor and sympy, ~0.6 s of a start; transformers' LlamaConfig module
    imports it itself, Qwen2Config's does not)."""
    code = (
        "import sys\n"
        "from pagedllm import LLM\n"
        f"LLM({str(tiny_qwen2)!r}, dtype='float32', kv_cache_memory_bytes=1 << 20, block_size=16)\n"
        "models = sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('pagedllm.model_executor.models.'))\n"
        "heavy = sorted(m for m in ('transformers.activations', 'sympy', 'accelerate') if m in sys.modules)\n"
        "print('models=' + ','.join(models)); print('heavy=' + ','.join(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if line.startswith(("models=", "heavy=")))
    models = set(lines["models"].split(","))
    assert {"llama", "registry"} <= models
    assert not {"bert", "llava", "clip", "qwen2_5_vl", "mamba2", "deepseek_v2", "mixtral"} & models
    assert lines["heavy"] == ""
