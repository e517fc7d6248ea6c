"""``pagedllm bench grammar-compile``: how long a JSON schema takes to compile for a model's
tokenizer, the first time (cold) and again (cached), through the engine's own
``StructuredOutputManager`` (what a request waits in WAITING_FOR_GRAMMAR).

Cold times compile a fresh variant of the schema each repeat (property names suffixed, so
no cache, ours or the backend's, holds it); cached times send the first variant again.
The backend itself (tokenizer and vocabulary tables) is built once before timing, as the
engine does on its first constrained request.

Example::

    pagedllm bench grammar-compile --model Qwen/Qwen2.5-0.5B-Instruct --num-repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

from pagedllm.benchmarks import machine_info, write_json
from pagedllm.config.engine_args import EngineArgs, add_engine_args, given_engine_kwargs

#: A typical 10-field object (a CRM-style record): strings with and without limits, an
#: enum, integers and a number with bounds, a boolean, a string array and a nested object.
TEN_FIELD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "created": {"type": "string", "format": "date"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "created", "address"],
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, unset=True)  # --model, --structured-outputs-config ...: as `pagedllm serve`
    parser.add_argument("--json-schema-path", default=None, help="a JSON schema file (default: a 10-field object)")
    parser.add_argument("--num-repeats", type=int, default=5, help="cold compiles timed (each a fresh variant)")
    parser.add_argument("--output-json", default=None)


def schema_variant(schema: dict[str, Any], index: int) -> dict[str, Any]:
    """``schema`` with every top-level property name suffixed by ``index`` (a new cache key)."""
    variant = copy.deepcopy(schema)
    properties = variant.get("properties", {})
    variant["properties"] = {f"{name}_{index}": value for name, value in properties.items()}
    if "required" in variant:
        variant["required"] = [f"{name}_{index}" for name in variant["required"]]
    return variant


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.sampling_params import StructuredOutputsParams
    from pagedllm.structured_output.manager import StructuredOutputManager

    config = EngineArgs(**given_engine_kwargs(args))
    engine_config = config.create_engine_config()
    manager = StructuredOutputManager(engine_config.structured_outputs_config, engine_config.model_config)
    schema = TEN_FIELD_SCHEMA
    if args.json_schema_path:
        with open(args.json_schema_path) as f:
            schema = json.load(f)

    def compile_seconds(variant: dict[str, Any]) -> float:
        start = time.perf_counter()
        request = manager.make_request(StructuredOutputsParams(json=variant))
        assert request.future is not None
        request.future.result()
        return time.perf_counter() - start

    compile_seconds({"type": "object"})  # builds the backend (tokenizer tables), untimed
    cold = [compile_seconds(schema_variant(schema, i)) for i in range(args.num_repeats)]
    cached = [compile_seconds(schema_variant(schema, 0)) for _ in range(args.num_repeats)]
    manager.shutdown()
    return {
        "benchmark": "grammar-compile",
        "model": str(engine_config.model_config.model_path),
        "backend": engine_config.structured_outputs_config.backend,
        "num_properties": len(schema.get("properties", {})),
        "cold_ms": [1000 * s for s in cold],
        "cached_ms": [1000 * s for s in cached],
        "median_cold_ms": 1000 * sorted(cold)[len(cold) // 2],
        "median_cached_ms": 1000 * sorted(cached)[len(cached) // 2],
        "machine": machine_info(),
    }


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(f"{result['num_properties']}-property JSON schema, backend {result['backend']}, {result['model']}")
    print(f"  compile, cold:   median {result['median_cold_ms']:.2f} ms  ({', '.join(f'{v:.2f}' for v in result['cold_ms'])})")
    print(f"  compile, cached: median {result['median_cached_ms']:.3f} ms")
    write_json(args.output_json, result)
    return 0
