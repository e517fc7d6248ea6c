"""The pooler fed chunk by chunk equals pooling the whole prompt; ``PoolingParams`` cuts and
normalizes as vLLM's embedding head; the pooler defaults read from sentence-transformers files
(either package layout) and the runner choice follow vLLM's rules; a classifier's activation
is chosen and applied as vLLM's."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.config.pooler import PoolerConfig, default_pooler_config, resolve_runner, sentence_transformers_pooler
from pagedllm.model_executor.layers.pooler import Pooler
from pagedllm.pooling_params import PoolingParams


@pytest.mark.parametrize(("pooling_type", "whole"), [
    ("MEAN", lambda h: h.mean(dim=0)), ("LAST", lambda h: h[-1]), ("CLS", lambda h: h[0])])
def test_chunks_pool_as_the_whole_prompt(pooling_type, whole):
    hidden = torch.randn(11, 8, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    pooler, state = Pooler(pooling_type), None
    for chunk in hidden.split([4, 1, 6]):
        state = pooler.update(state, chunk)
    torch.testing.assert_close(pooler.finish(state), whole(hidden.float()))


def test_pooling_params_cut_then_normalize():
    assert PoolingParams(dimensions=2, normalize=True).apply([3.0, 4.0, 12.0]) == [0.6, 0.8]
    assert PoolingParams(normalize=False).apply([3.0, 4.0]) == [3.0, 4.0]
    assert PoolingParams(normalize=True).apply([0.0, 0.0]) == [0.0, 0.0]


def _write_st(folder, pooling: dict, module_types: list[str]) -> None:
    modules = [{"idx": i, "name": str(i), "path": f"{i}_{t.rsplit('.', 1)[-1]}", "type": t}
               for i, t in enumerate(module_types)]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_sentence_transformers_files_set_the_defaults(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    _write_st(old, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
              ["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"])
    _write_st(new, {"pooling_mode": "lasttoken"}, [
        "sentence_transformers.base.modules.transformer.Transformer",
        "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        "sentence_transformers.base.modules.normalize.Normalize"])
    assert sentence_transformers_pooler(old) == PoolerConfig("CLS", False)
    assert sentence_transformers_pooler(new) == PoolerConfig("LAST", True)
    assert sentence_transformers_pooler(tmp_path) == PoolerConfig()
    assert default_pooler_config("Qwen3ForCausalLM", tmp_path, PoolerConfig()) == PoolerConfig("LAST", True)
    assert default_pooler_config("BertModel", tmp_path, PoolerConfig()) == PoolerConfig("CLS", True)
    user = PoolerConfig.from_dict({"pooling_type": "mean"})
    assert default_pooler_config("BertModel", old, user) == PoolerConfig("MEAN", False)
    (old / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ValueError, match="pooling mode max is not supported"):
        sentence_transformers_pooler(old)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig.from_dict({"pooling_type": "ALL"})
    with pytest.raises(ValueError, match="unknown key"):
        PoolerConfig.from_dict({"pooling": "MEAN"})


def test_runner_auto_follows_the_architecture_and_convert():
    assert resolve_runner("auto", "auto", "BertModel") == "pooling"
    assert resolve_runner("auto", "embed", "Qwen3ForCausalLM") == "pooling"
    assert resolve_runner("auto", "auto", "Qwen3ForCausalLM") == "generate"
    assert resolve_runner("pooling", "none", "LlamaForCausalLM") == "pooling"
    with pytest.raises(ValueError, match="BertModel is an encoder"):
        resolve_runner("generate", "auto", "BertModel")


def test_classifiers_run_pooling_with_vllm_activations(tmp_path):
    from types import SimpleNamespace

    from pagedllm.config.pooler import classification_activation, cross_encoder_activation
    from pagedllm.pooling_params import activate

    assert resolve_runner("auto", "auto", "Qwen3ForSequenceClassification") == "pooling"
    assert resolve_runner("auto", "classify", "LlamaForCausalLM") == "pooling"
    with pytest.raises(ValueError, match="--convert classify makes a pooling model"):
        resolve_runner("generate", "classify", "LlamaForCausalLM")
    config = SimpleNamespace
    assert classification_activation(config(num_labels=3)) == "softmax"
    assert classification_activation(config(num_labels=1)) == "sigmoid"
    assert classification_activation(config(num_labels=3, problem_type="multi_label_classification")) == "sigmoid"
    assert classification_activation(config(num_labels=1, problem_type="regression")) == "identity"
    assert cross_encoder_activation(config(num_labels=1), tmp_path) == "sigmoid"
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.linear.Identity"}))
    assert cross_encoder_activation(config(num_labels=1), tmp_path) == "identity"
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": "torch.nn.ReLU"}))
    with pytest.raises(ValueError, match="activation_fn 'torch.nn.ReLU' is not supported"):
        cross_encoder_activation(config(num_labels=1), tmp_path)
    logits = [0.5, -1.0, 2.0]
    torch.testing.assert_close(torch.tensor(activate(logits, "softmax")), torch.softmax(torch.tensor(logits), 0),
                               atol=1e-7, rtol=0, check_dtype=False)
    torch.testing.assert_close(torch.tensor(activate([-40.0, 3.0], "sigmoid"), dtype=torch.float64),
                               torch.sigmoid(torch.tensor([-40.0, 3.0], dtype=torch.float64)))
