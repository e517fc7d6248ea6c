"""``pagedllm.envs``: one rule for switches, vLLM's names read second, every read of a product
variable through a declaration, and the documentation written from the declarations."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "pagedllm"
#: The one module that reads PAGEDLLM_ / VLLM_ variables from ``os.environ`` itself.
READS_ALLOWED = {"pagedllm/envs.py"}
PREFIXES = ("PAGEDLLM_", "VLLM_")


@pytest.fixture
def clean_env(monkeypatch):
    """No declared variable set, by either name."""
    for variable in envs.VARIABLES:
        for name in variable.names:
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- the switch rule ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "True", "yes", "Yes", "on", "ON", " on ", "true\n"])
def test_true_spellings(clean_env, text):
    assert envs.parse_bool("X", text) is True
    clean_env.setenv("PAGEDLLM_DISABLE_CPU_KERNELS", text)
    assert envs.PAGEDLLM_DISABLE_CPU_KERNELS.get() is True


@pytest.mark.parametrize("text", ["0", "false", "FALSE", "False", "no", "No", "off", "OFF", "", "  "])
def test_false_spellings(clean_env, text):
    assert envs.parse_bool("X", text) is False
    clean_env.setenv("PAGEDLLM_CPU_INT8_ACTIVATIONS", text)  # default on: the value turns it off
    assert envs.PAGEDLLM_CPU_INT8_ACTIVATIONS.get() is False


@pytest.mark.parametrize("text", ["2", "-1", "y", "n", "enabled", "disable", "truee", "1.0"])
def test_other_spellings_are_refused_naming_the_variable(clean_env, text):
    clean_env.setenv("PAGEDLLM_BATCH_INVARIANT", text)
    with pytest.raises(ValueError, match=rf"PAGEDLLM_BATCH_INVARIANT={text!r} is not a boolean: use 1, true"):
        envs.PAGEDLLM_BATCH_INVARIANT.get()


def test_unset_switches_take_their_default(clean_env):
    assert envs.PAGEDLLM_DISABLE_CPU_KERNELS.get() is False
    assert envs.PAGEDLLM_CPU_INT8_ACTIVATIONS.get() is True


def test_disable_cpu_kernels_false_keeps_kernels_and_onednn_packing(clean_env):
    """``PAGEDLLM_DISABLE_CPU_KERNELS=false`` means what it says for the kernels and for
    oneDNN packing alike (packing used to read it as "set")."""
    import torch

    from pagedllm.kernels.cpu import runtime
    from pagedllm.model_executor.layers import cpu_gemm

    weight = torch.zeros(8, 8)
    packable = cpu_gemm.can_pack(weight)
    for text in ("false", "no", "off", "FALSE"):
        clean_env.setenv("PAGEDLLM_DISABLE_CPU_KERNELS", text)
        assert runtime._disabled_by_env() is False
        assert cpu_gemm.can_pack(weight) is packable
    clean_env.setenv("PAGEDLLM_DISABLE_CPU_KERNELS", "on")
    assert runtime._disabled_by_env() is True
    assert cpu_gemm.can_pack(weight) is False


# --- vLLM's names ---------------------------------------------------------------------------

#: (declaration, a value, another value, the parsed first, the parsed second)
ALIASED = [
    (envs.PAGEDLLM_API_KEY, "ours", "theirs", "ours", "theirs"),
    (envs.PAGEDLLM_LOG_STATS_INTERVAL, "2", "3", 2.0, 3.0),
    (envs.PAGEDLLM_WORKER_MULTIPROC_METHOD, "spawn", "fork", "spawn", "fork"),
    (envs.PAGEDLLM_CPU_KVCACHE_SPACE, "4", "2", 4.0, 2.0),
]


def test_the_aliases_are_the_ones_read_before():
    aliases = {v.name: v.alias for v in envs.VARIABLES if v.alias}
    assert aliases == {
        "PAGEDLLM_API_KEY": "VLLM_API_KEY",
        "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "PAGEDLLM_LOG_STATS_INTERVAL": "VLLM_LOG_STATS_INTERVAL",
        "PAGEDLLM_IMAGE_FETCH_TIMEOUT": "VLLM_IMAGE_FETCH_TIMEOUT",
        "PAGEDLLM_VIDEO_FETCH_TIMEOUT": "VLLM_VIDEO_FETCH_TIMEOUT",
        "PAGEDLLM_BATCH_INVARIANT": "VLLM_BATCH_INVARIANT",
        "PAGEDLLM_CPU_KVCACHE_SPACE": "VLLM_CPU_KVCACHE_SPACE",
        "PAGEDLLM_WORKER_MULTIPROC_METHOD": "VLLM_WORKER_MULTIPROC_METHOD",
    }


@pytest.mark.parametrize("variable, ours, theirs, ours_value, theirs_value", ALIASED, ids=lambda v: getattr(v, "name", ""))
def test_ours_first_then_vllms(clean_env, variable, ours, theirs, ours_value, theirs_value):
    clean_env.setenv(variable.alias, theirs)
    assert variable.lookup() == (variable.alias, theirs, theirs_value)
    clean_env.setenv(variable.name, ours)
    assert variable.lookup() == (variable.name, ours, ours_value)
    clean_env.setenv(variable.name, "")  # empty: unset, vLLM's is read
    assert variable.get() == theirs_value


@pytest.mark.parametrize("variable", [envs.PAGEDLLM_BATCH_INVARIANT, envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING])
def test_a_switch_is_on_when_either_name_turns_it_on(clean_env, variable):
    for ours, theirs, expected in [("0", "1", True), ("1", "0", True), ("0", "0", False), ("off", "yes", True)]:
        clean_env.setenv(variable.name, ours)
        clean_env.setenv(variable.alias, theirs)
        assert variable.get() is expected, (ours, theirs)
    clean_env.delenv(variable.name)
    clean_env.setenv(variable.alias, "no")
    assert variable.lookup() == (variable.alias, "no", False)
    clean_env.setenv(variable.alias, "true")
    assert variable.lookup() == (variable.alias, "true", True)


def test_callers_read_both_names(clean_env):
    import argparse

    from pagedllm.entrypoints.openai.cli_args import resolve_api_key
    from pagedllm.metrics.loggers import log_stats_interval

    no_key = argparse.Namespace(api_key=None)
    assert resolve_api_key(no_key) is None and log_stats_interval() == 10.0
    clean_env.setenv("VLLM_API_KEY", " with spaces ")  # a key is taken as it is
    clean_env.setenv("VLLM_LOG_STATS_INTERVAL", "0.5")
    assert resolve_api_key(no_key) == [" with spaces "]
    assert log_stats_interval() == 0.5
    clean_env.setenv("PAGEDLLM_API_KEY", "k")
    assert resolve_api_key(no_key) == ["k"]
    assert resolve_api_key(argparse.Namespace(api_key=["a", "b"])) == ["a", "b"]


@pytest.mark.parametrize(
    "ours, theirs, expected",
    [
        ("4", None, (4 * 2**30, "PAGEDLLM_CPU_KVCACHE_SPACE=4 GiB")),
        ("0", "2", (2 * 2**30, "VLLM_CPU_KVCACHE_SPACE=2 GiB")),
        (None, "2", (2 * 2**30, "VLLM_CPU_KVCACHE_SPACE=2 GiB")),
        (" 1.5 ", "2", (int(1.5 * 2**30), "PAGEDLLM_CPU_KVCACHE_SPACE=1.5 GiB")),
        ("-1", "2", (2 * 2**30, "VLLM_CPU_KVCACHE_SPACE=2 GiB")),
        ("0", None, (None, "")),
        ("", "0.5", (2**29, "VLLM_CPU_KVCACHE_SPACE=0.5 GiB")),
    ],
)
def test_cpu_kvcache_space(clean_env, ours, theirs, expected):
    """vLLM-CPU's rule: GiB, 0 or less counts as unset (the next name is read)."""
    from pagedllm.config.cache import _cpu_kvcache_space_env
    from pagedllm.platforms import current_platform

    if not current_platform.is_cpu:
        pytest.skip("the variable is read on CPU only")
    for name, value in (("PAGEDLLM_CPU_KVCACHE_SPACE", ours), ("VLLM_CPU_KVCACHE_SPACE", theirs)):
        if value is not None:
            clean_env.setenv(name, value)
    assert _cpu_kvcache_space_env() == expected


def test_cpu_kvcache_space_not_a_number(clean_env):
    from pagedllm.config.cache import _cpu_kvcache_space_env
    from pagedllm.platforms import current_platform

    if not current_platform.is_cpu:
        pytest.skip("the variable is read on CPU only")
    clean_env.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KVCACHE_SPACE must be a number of GiB, got 'lots'"):
        _cpu_kvcache_space_env()


@pytest.mark.parametrize(
    "ours, theirs, expected",
    [("1", None, True), (None, "yes", True), ("0", "true", True), ("no", "0", False), (None, None, False)],
)
def test_batch_invariant_from_env(clean_env, ours, theirs, expected):
    from pagedllm.config import EngineArgs, batch_invariant_from_env

    for name, value in (("PAGEDLLM_BATCH_INVARIANT", ours), ("VLLM_BATCH_INVARIANT", theirs)):
        if value is not None:
            clean_env.setenv(name, value)
    assert batch_invariant_from_env() is expected
    assert EngineArgs().batch_invariant is expected


# --- numbers and words ------------------------------------------------------------------------


def test_numbers_and_choices_are_read_when_called(clean_env):
    assert envs.PAGEDLLM_PP_MAX_CONCURRENT_BATCHES.get() is None
    clean_env.setenv("PAGEDLLM_PP_MAX_CONCURRENT_BATCHES", " 3 ")
    assert envs.PAGEDLLM_PP_MAX_CONCURRENT_BATCHES.get() == 3
    clean_env.setenv("PAGEDLLM_PP_MAX_CONCURRENT_BATCHES", "  ")
    assert envs.PAGEDLLM_PP_MAX_CONCURRENT_BATCHES.get() is None
    clean_env.setenv("PAGEDLLM_CPU_COLLECTIVES", " GLOO ")
    assert envs.PAGEDLLM_CPU_COLLECTIVES.get() == "gloo"
    assert envs.PAGEDLLM_CPU_FP32_WEIGHT_COPY.get() == "auto"
    clean_env.setenv("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", "2.5")
    assert envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S.get() == 2.5
    assert envs.PAGEDLLM_CPU_OMP_THREADS_BIND.get() == "auto"
    assert envs.PAGEDLLM_LOGGING_LEVEL.get() == "INFO"


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("PAGEDLLM_PP_MAX_CONCURRENT_BATCHES", "2.0", "PAGEDLLM_PP_MAX_CONCURRENT_BATCHES='2.0' must be a positive integer (steps in flight)."),
        ("PAGEDLLM_PP_MAX_CONCURRENT_BATCHES", "0", "PAGEDLLM_PP_MAX_CONCURRENT_BATCHES='0' must be a positive integer (steps in flight)."),
        ("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S", "soon", "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S='soon' must be a number."),
        ("PAGEDLLM_CPU_FP32_WEIGHT_COPY", " Yes", "PAGEDLLM_CPU_FP32_WEIGHT_COPY='yes': use auto, 0 or 1."),
        ("VLLM_WORKER_MULTIPROC_METHOD", "forkserver", "VLLM_WORKER_MULTIPROC_METHOD='forkserver': use fork or spawn."),
        ("VLLM_CPU_KVCACHE_SPACE", "lots", "VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got 'lots'."),
        ("PAGEDLLM_LOG_STATS_INTERVAL", "nan", "PAGEDLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got 'nan'."),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_variable(clean_env, name, text, message):
    clean_env.setenv(name, text)
    variable = next(v for v in envs.VARIABLES if name in v.names)
    with pytest.raises(ValueError) as info:
        variable.get()
    assert str(info.value) == message


def test_a_bad_declaration_is_refused():
    with pytest.raises(ValueError, match="kind must be one of bool, int, float, str, choice"):
        envs.EnvVar("PAGEDLLM_X", "list", None, "doc")
    with pytest.raises(ValueError, match="choices go with kind 'choice'"):
        envs.EnvVar("PAGEDLLM_X", "choice", None, "doc")


def test_declarations_are_named_as_their_variables():
    names = [name for v in envs.VARIABLES for name in v.names]
    assert len(names) == len(set(names))
    for variable in envs.VARIABLES:
        assert getattr(envs, variable.name) is variable
        assert variable.name.startswith("PAGEDLLM_") and (variable.alias or "VLLM_").startswith("VLLM_")
        assert variable.doc and "\n" not in variable.doc


# --- reads go through envs.py ---------------------------------------------------------------


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")  # fmt: skip


def _read_keys(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, key expression) of each read of one variable: ``os.environ.get(k)`` / ``.pop(k)``,
    ``os.getenv(k)``, ``os.environ[k]`` (not assigned or deleted), ``k in os.environ``.
    Writes (``os.environ[k] = v``, ``setdefault``, ``update``) and copies are not reads."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            environ_call = isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and _is_environ(func.value)
            getenv = (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            )
            if environ_call or getenv:
                keys.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            keys.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_environ(c) for c in node.comparators):
                keys.append((node.lineno, node.left))
    return keys


def _product_reads(source: str) -> list[int]:
    """Lines of ``source`` that read a PAGEDLLM_ / VLLM_ variable, or a variable named by
    anything but a string literal (a constant, a loop over names: the test cannot tell
    which, so it must be read through ``pagedllm.envs``)."""
    lines = []
    for line, key in _read_keys(ast.parse(source)):
        literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
        if not literal or key.value.startswith(PREFIXES):
            lines.append(line)
    return lines


def test_the_read_finder_sees_every_form():
    source = "\n".join([
        "import os",
        "ENV = 'PAGEDLLM_X'",
        "a = os.environ.get('PAGEDLLM_A')",  # 3
        "b = os.getenv('VLLM_B', '')",  # 4
        "c = os.environ[ENV]",  # 5
        "d = ENV in os.environ",  # 6
        "for name in ('PAGEDLLM_E', 'VLLM_E'):",
        "    e = os.environ.get(name)",  # 8
        "os.environ['PAGEDLLM_F'] = '1'",
        "os.environ.setdefault('PAGEDLLM_G', '1')",
        "os.environ.update({ENV: 'gloo'})",
        "env = {**os.environ, 'PAGEDLLM_H': '1'}",
        "seed = os.environ.get('PYTHONHASHSEED')",
        "del os.environ['PAGEDLLM_I']",
    ])  # fmt: skip
    assert _product_reads(source) == [3, 4, 5, 6, 8]


def test_product_variables_are_read_through_envs_only():
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative, source = path.relative_to(ROOT).as_posix(), path.read_text()
        if relative not in READS_ALLOWED and ("environ" in source or "getenv" in source):
            found += [f"{relative}:{line}" for line in _product_reads(source)]
    assert found == [], "read these through pagedllm.envs (declare the variable there)"


# --- documentation ----------------------------------------------------------------------------


def test_docs_environment_md_is_up_to_date():
    doc = ROOT / "docs" / "environment.md"
    assert doc.read_text() == envs.markdown_page(), "run: .venv/bin/python tools/write_environment_doc.py"


def test_the_page_lists_every_variable_once():
    page = envs.markdown_page()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [v.name for v in envs.VARIABLES]
    assert "| `PAGEDLLM_API_KEY` | `VLLM_API_KEY` | str | `unset` |" in page
    assert "| `PAGEDLLM_CPU_INT8_ACTIVATIONS` |  | bool | `1` |" in page
    assert all(row.count(" | ") == 4 for row in rows)  # a "|" in a doc is escaped


def test_help_epilog_lists_every_variable_and_its_default():
    text = envs.help_epilog(width=80)
    lines = text.splitlines()
    assert lines[0] == "Environment variables:"
    assert "  PAGEDLLM_WORKER_MULTIPROC_METHOD, VLLM_WORKER_MULTIPROC_METHOD" in lines
    assert all(len(line) <= 80 for line in lines)
    for variable in envs.VARIABLES:
        assert "  " + ", ".join(variable.names) in lines
    assert "default: 60)" in text and "`" not in text


def test_serve_help_lists_every_variable():
    """``pagedllm serve --help`` ends with the declarations' list, line breaks kept."""
    import argparse

    from pagedllm.entrypoints.openai import cli_args

    parser = cli_args.register(argparse.ArgumentParser(prog="pagedllm").add_subparsers())
    text = parser.format_help()
    assert text.rstrip().endswith(envs.help_epilog().splitlines()[-1].strip())
    for variable in envs.VARIABLES:
        assert f"\n  {', '.join(variable.names)}\n" in text
