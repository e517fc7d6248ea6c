"""``PoolerConfig`` and the runner choice: how a pooling model turns hidden states into one
vector per prompt (vLLM's ``--runner``, ``--convert`` and ``--pooler-config``).

Defaults, in vLLM's order of precedence: ``--pooler-config`` over the model's
sentence-transformers files (``modules.json``: its ``Pooling`` module's
``1_Pooling/config.json`` mode, and ``normalize`` when a ``Normalize`` module follows), over
the architecture's own default (CLS for a BERT-style encoder, LAST for a decoder used as an
embedder), with ``normalize`` True for embeddings. Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

#: ``--runner`` values (vLLM's; "draft" is a speculative drafter's and is not taken here).
RUNNER_TYPES = ("auto", "generate", "pooling")
#: ``--convert`` values: "embed" serves a generative checkpoint as an embedder, "classify" as
#: a sequence classifier (a ``score`` head on the last token); "none" and "auto" keep the
#: architecture as it is.
CONVERT_TYPES = ("auto", "none", "embed", "classify")
#: ``pooling_type`` values built here.
POOLING_TYPES = ("LAST", "MEAN", "CLS")

#: Encoder architectures: served by the pooling runner, one bidirectional pass per prompt.
ENCODER_ARCHITECTURES = (
    "BertModel", "RobertaModel", "XLMRobertaModel",
    "BertForSequenceClassification", "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification",
    "ModernBertModel", "ModernBertForSequenceClassification",
)
#: The suffix of a sequence classifier's architecture name (transformers' naming): the
#: pooling runner serves it for the "classify" and "score" tasks.
CLASSIFIER_SUFFIX = "ForSequenceClassification"

#: Cross-encoder activations that sentence-transformers names (``activation_fn``) -> ours.
_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
}

#: sentence-transformers' pooling modes -> ``pooling_type``: its ``pooling_mode`` values, and
#: (older files) its ``pooling_mode_*`` switches.
_ST_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_POOLING_SWITCHES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


@dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become one embedding per prompt.

    ``pooling_type``: "LAST" (the last prompt token's final hidden state), "MEAN" (the
    mean over all prompt tokens) or "CLS" (the first token's); None: the model's default.
    ``normalize``: the vector is divided by its L2 norm (None: the default, True).
    """

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None

    @classmethod
    def from_dict(cls, values: Optional[dict[str, Any]]) -> PoolerConfig:
        """The config of ``--pooler-config``'s JSON object (None: all defaults).

        Raises:
            ValueError: an unknown key, a ``pooling_type`` not in ``POOLING_TYPES``, or a
                ``normalize`` that is not a boolean.
        """
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"pooler_config has unknown key(s) {unknown}; known: {sorted(known)}.")
        pooling_type = values.get("pooling_type")
        if pooling_type is not None:
            pooling_type = str(pooling_type).upper()
            if pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config pooling_type must be one of {POOLING_TYPES}, "
                                 f"got {values['pooling_type']!r}.")
        normalize = values.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {normalize!r}.")
        return cls(pooling_type, normalize)

    def with_defaults(self, defaults: PoolerConfig) -> PoolerConfig:
        """This config, its unset fields taken from ``defaults``."""
        return PoolerConfig(
            self.pooling_type if self.pooling_type is not None else defaults.pooling_type,
            self.normalize if self.normalize is not None else defaults.normalize,
        )


def is_encoder_architecture(architecture: str) -> bool:
    """Whether ``architecture`` is an encoder served by the pooling runner (``ENCODER_ARCHITECTURES``)."""
    return architecture in ENCODER_ARCHITECTURES


def encoder_context_len(hf_config: Any) -> Optional[int]:
    """The longest prompt an encoder's position table holds: for RoBERTa-style models
    (positions from ``pad_token_id + 1``) ``max_position_embeddings - pad_token_id - 1``;
    None for any other architecture (its ``max_position_embeddings``)."""
    architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
    if architecture not in ("RobertaModel", "XLMRobertaModel"):
        return None
    return hf_config.max_position_embeddings - hf_config.pad_token_id - 1


def is_classifier(architecture: str, convert: str) -> bool:
    """Whether the model is a sequence classifier (tasks "classify" and "score"): a
    ``*ForSequenceClassification`` architecture, or any checkpoint with ``--convert classify``."""
    return architecture.endswith(CLASSIFIER_SUFFIX) or convert == "classify"


#: vLLM's earlier ``--task`` values built here (``None`` / "auto": ``--runner`` and ``--convert`` decide).
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")


def runner_and_convert(task: Optional[str], runner: str, convert: str, architecture: str) -> tuple[str, str]:
    """(``runner``, ``convert``) with vLLM's earlier ``task`` filling those left "auto":
    "generate" -> the generate runner; "embed" / "embedding" and "classify" / "score" -> the
    pooling runner, converting a causal LM (``convert`` "embed" / "classify") unless the
    architecture already pools (an encoder, a ``*ForSequenceClassification``).
    ``EngineArgs`` refuses a task not in ``TASKS``."""
    if task is None or task == "auto":
        return runner, convert
    if task == "generate":
        return ("generate" if runner == "auto" else runner), convert
    pools = is_encoder_architecture(architecture) or architecture.endswith(CLASSIFIER_SUFFIX)
    if convert == "auto" and not pools:
        convert = "embed" if task in ("embed", "embedding") else "classify"
    return ("pooling" if runner == "auto" else runner), convert


def resolve_runner(runner: str, convert: str, architecture: str) -> str:
    """The runner ("generate" or "pooling") of ``--runner`` / ``--convert`` for ``architecture``
    (vLLM's rule: "auto" is "pooling" for an encoder, a sequence classifier, or with
    ``--convert embed`` / ``classify``).

    Raises:
        ValueError: an unknown value, ``--runner generate`` for an encoder or a classifier,
            or ``--convert embed`` / ``classify`` with ``--runner generate``.
    """
    if runner not in RUNNER_TYPES:
        raise ValueError(f"runner must be one of {RUNNER_TYPES}, got {runner!r}.")
    if convert not in CONVERT_TYPES:
        raise ValueError(f"convert must be one of {CONVERT_TYPES}, got {convert!r}.")
    encoder = is_encoder_architecture(architecture)
    pooling = encoder or convert in ("embed", "classify") or architecture.endswith(CLASSIFIER_SUFFIX)
    if runner == "auto":
        return "pooling" if pooling else "generate"
    if runner == "generate" and pooling:
        why = f"{architecture} is an encoder" if encoder else (
            f"--convert {convert} makes a pooling model" if convert in ("embed", "classify")
            else f"{architecture} is a classifier")
        raise ValueError(f"runner='generate' cannot serve this model ({why}); use --runner pooling.")
    return runner


def set_classifier_from_token(hf_config: Any) -> None:
    """For a classifier made from a causal LM's vocabulary (config.json or ``--hf-overrides``'
    ``classifier_from_token``, vLLM's key: the tokens whose LM-head rows become the score
    head), set ``num_labels``: 1 for two tokens (vLLM's "from_2_way_softmax": the score is the
    second token's logit less the first's), else one label per token. No-op without the key.
    A Qwen3-Reranker checkpoint (``is_original_qwen3_reranker``, vLLM's key) needs two tokens.

    Raises:
        ValueError: ``classifier_from_token`` not a list of at least two strings (of two with
            ``is_original_qwen3_reranker``).
    """
    tokens = getattr(hf_config, "classifier_from_token", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False) and (not isinstance(tokens, list) or len(tokens) != 2):
        raise ValueError("is_original_qwen3_reranker needs classifier_from_token of two tokens, "
                         f'["no", "yes"] (the model card\'s); got {tokens!r}.')
    if tokens is None:
        return
    if not isinstance(tokens, list) or len(tokens) < 2 or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of two or more tokens, got {tokens!r}.")
    hf_config.num_labels = 1 if len(tokens) == 2 else len(tokens)


def classification_activation(hf_config: Any) -> str:
    """The activation of the "classify" task's logits, as transformers' loss for the config's
    ``problem_type`` (vLLM's rule): "identity" for regression, "sigmoid" for multi-label or
    a single label, else "softmax" over the labels."""
    problem_type = getattr(hf_config, "problem_type", None)
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if getattr(hf_config, "num_labels", 2) < 2 else "softmax"


def cross_encoder_activation(hf_config: Any, model_dir: Path) -> str:
    """The activation of the "score" task's logits: the ``activation_fn`` a sentence-transformers
    CrossEncoder saved (``config_sentence_transformers.json``, or config.json's
    ``sentence_transformers`` / ``sbert_ce_default_activation_function``), else sigmoid for one
    label and softmax for more (vLLM's rule).

    Raises:
        ValueError: an ``activation_fn`` other than Sigmoid, Tanh or Identity.
    """
    st_file = model_dir / "config_sentence_transformers.json"
    name = json.loads(st_file.read_text()).get("activation_fn") if st_file.is_file() else None
    name = name or (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn")
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return "sigmoid" if getattr(hf_config, "num_labels", 2) < 2 else "softmax"
    if name not in _ST_ACTIVATIONS:
        raise ValueError(f"Cross-encoder activation_fn {name!r} is not supported; supported: {sorted(_ST_ACTIVATIONS)}.")
    return _ST_ACTIVATIONS[name]


def sentence_transformers_pooler(model_dir: Path) -> PoolerConfig:
    """The pooling that the sentence-transformers files of ``model_dir`` describe (unset
    fields when there are none): its ``Pooling`` module's mode, and ``normalize`` True
    when a ``Normalize`` module is listed, False when not (as vLLM's ``get_pooling_config``).
    Modules are known by class name (older and newer sentence-transformers name their
    packages differently).

    Raises:
        ValueError: a ``Pooling`` module whose mode is not CLS, MEAN or LAST (e.g. max).
    """
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    modules = json.loads(modules_file.read_text())
    class_names = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    normalize = "Normalize" in class_names
    if "Pooling" not in class_names:
        return PoolerConfig(None, normalize)
    config_file = model_dir / modules[class_names.index("Pooling")].get("path", "") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    mode = config.get("pooling_mode")
    modes = [_ST_POOLING_MODES[mode]] if mode in _ST_POOLING_MODES else []
    modes += [kind for key, kind in _ST_POOLING_SWITCHES.items() if mode is None and config.get(key)]
    if not modes:
        given = mode or sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
        raise ValueError(f"{config_file}: pooling mode {given} is not supported; "
                         f"supported: {sorted(_ST_POOLING_MODES)}.")
    return PoolerConfig(modes[0], normalize)


def architecture_pooling_type(architecture: str, hf_config: Any = None) -> str:
    """The architecture's own pooling: a ModernBERT classifier's ``classifier_pooling`` ("cls"
    / "mean", as transformers' head pools), else CLS for an encoder, LAST otherwise."""
    if architecture == "ModernBertForSequenceClassification":
        return str(getattr(hf_config, "classifier_pooling", None) or "cls").upper()
    return "CLS" if is_encoder_architecture(architecture) else "LAST"


def default_pooler_config(architecture: str, model_dir: Path, user: PoolerConfig,
                          hf_config: Any = None) -> PoolerConfig:
    """``user``'s fields, else the sentence-transformers files', else the architecture's
    default (``architecture_pooling_type`` of ``hf_config``; ``normalize`` True)."""
    arch_default = PoolerConfig(architecture_pooling_type(architecture, hf_config), True)
    return user.with_defaults(sentence_transformers_pooler(model_dir)).with_defaults(arch_default)
