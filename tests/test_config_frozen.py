"""``create_engine_config``'s sub-configs refuse changes; the number of KV-cache blocks is the
engine's run-time state, not a config field."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.config import EngineArgs


def test_sub_configs_are_frozen(tiny_llama):
    config = EngineArgs(
        model=str(tiny_llama), enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        role="decode", enable_prefix_caching=False,
    ).create_engine_config(log_choices=False)
    subs = [getattr(config, f.name) for f in dataclasses.fields(config)]
    assert len(subs) == 10 and all(sub is not None for sub in subs)
    for sub in subs:
        name = dataclasses.fields(sub)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sub, name, getattr(sub, name))
    assert config.lora_config.max_cpu_loras == 1  # filled in from max_loras while frozen
    assert "num_gpu_blocks" not in {f.name for f in dataclasses.fields(config.cache_config)}
