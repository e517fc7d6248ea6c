"""Where a model is: a local folder, a ``.gguf`` file or a Hugging Face Hub id (downloaded);
its Hugging Face config, with ``--hf-overrides`` merged in."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pagedllm.arch_config import language_model_config
from pagedllm.config.gguf_moe import complete_moe_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


#: Files of a Hub repo that a model needs (weights, configs, tokenizer, chat template):
#: downloads skip everything else (other weight formats, images, training files).
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")


def resolve_model_path(
    model: Optional[str], revision: Optional[str] = None, download_dir: Optional[str] = None
) -> Path:
    """A local directory (or GGUF file) for ``model``: a directory, a ``.gguf`` file, or a
    Hugging Face Hub id downloaded (or found in the cache) as vLLM does.

    ``None`` means the small model that ships inside the package. A Hub id is fetched with
    ``huggingface_hub.snapshot_download`` (only ``HUB_ALLOW_PATTERNS``), at ``revision``
    (branch, tag or commit; default ``main``), into ``download_dir`` (default: the Hugging
    Face cache, ``$HF_HOME/hub``). ``huggingface_hub`` honours ``HF_TOKEN`` (gated and
    private repos), ``HF_ENDPOINT`` (a mirror) and ``HF_HUB_OFFLINE=1`` (cache only).

    Raises:
        ValueError: if ``model`` is neither a directory nor a Hub id that could be fetched;
            the message says why (not found, access denied, offline and not cached, no network).
    """
    if model is None:
        from pagedllm.model_paths import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(
            f"Model {model!r} is not a local directory with config.json and *.safetensors, nor a .gguf file."
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(
            snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=list(HUB_ALLOW_PATTERNS))
        )
    except GatedRepoError as exc:
        reason = "is gated: accept its terms on the Hub and set HF_TOKEN to a token with access"
        raise ValueError(f"Model {where} {reason}.") from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"Model {model!r} has no revision {revision!r} on {constants.ENDPOINT}.") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(
            f"Model {model!r} is not a local directory, and {constants.ENDPOINT} has no such model "
            "(or it is private: set HF_TOKEN)."
        ) from exc
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"{constants.ENDPOINT} could not be reached"
        raise ValueError(
            f"Model {where} is not a local directory and not in the Hugging Face cache "
            f"({download_dir or constants.HF_HUB_CACHE}), and {why}."
        ) from exc
    except HfHubHTTPError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"Model {where} could not be downloaded from {constants.ENDPOINT}: {first_line}") from exc


def load_hf_config(
    model_path: Path, trust_remote_code: bool = False, hf_overrides: Optional[dict] = None
) -> PretrainedConfig:
    """The model's Hugging Face config: config.json of a directory, or, for a ``.gguf`` file,
    the one transformers builds from the file's metadata (architecture and hyper-parameters;
    the expert settings it leaves out added, ``gguf_moe``; ``architectures`` filled in from the
    model type when the file does not name it); then
    ``hf_overrides`` merged into it (``apply_hf_overrides``). For an image-text checkpoint served
    by its language model, that model's config after the overrides
    (``pagedllm.arch_config.language_model_config``).

    Raises:
        ValueError: no readable config (transformers' message); bad ``hf_overrides``.
    """
    hf_config = _read_hf_config(model_path, trust_remote_code)
    if hf_overrides:
        apply_hf_overrides(hf_config, hf_overrides)
    return language_model_config(hf_config)


def _read_hf_config(model_path: Path, trust_remote_code: bool) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        if model_path.suffix != ".gguf":
            return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_config = AutoConfig.from_pretrained(model_path.parent, gguf_file=model_path.name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read the model config of {model_path}: {exc}") from exc
    hf_config = complete_moe_config(hf_config, model_path)
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type, hf_config.model_type)]
    return hf_config


def apply_hf_overrides(hf_config: Any, overrides: dict) -> None:
    """Merge ``overrides`` (vLLM's ``--hf-overrides``) into ``hf_config``, in place.

    Each key is set on the config; where the config's value is a dict (``rope_parameters``)
    or a sub-config (``text_config``) and the override a dict, it is merged into it key by
    key, recursively, so '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}' keeps
    the config's ``rope_theta``. On a transformers-5 config the 4.x keys ``rope_scaling``
    and ``rope_theta`` are merged into ``rope_parameters`` (where transformers keeps them;
    a null ``rope_scaling`` is the "default" rope) and a rope ``type`` names the
    ``rope_type``. The rope parameters are then standardized as transformers does at load
    (``standardize_rope_params``: ``original_max_position_embeddings`` ...).

    Raises:
        ValueError: ``overrides`` is not a dict.
    """
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object (dict), got {type(overrides).__name__}: {overrides!r}.")
    _merge_into(hf_config, _rope_overrides(hf_config, overrides))
    standardize = getattr(hf_config, "standardize_rope_params", None)
    if callable(standardize) and getattr(hf_config, "rope_parameters", None):
        standardize()


def _rope_overrides(hf_config: Any, overrides: dict) -> dict:
    """``overrides`` with 4.x rope keys moved into ``rope_parameters`` on a config that keeps
    its rope there (a flat dict), and a rope ``type`` copied to ``rope_type``."""
    overrides = dict(overrides)
    current = getattr(hf_config, "rope_parameters", None)
    if isinstance(current, dict) and not any(isinstance(v, dict) for v in current.values()):
        rope = {}
        if "rope_scaling" in overrides:
            rope.update(overrides.pop("rope_scaling") or {"rope_type": "default"})
        if "rope_theta" in overrides:
            rope["rope_theta"] = overrides.pop("rope_theta")
        if rope or "rope_parameters" in overrides:
            overrides["rope_parameters"] = {**rope, **(overrides.get("rope_parameters") or {})}
    rope = overrides.get("rope_parameters")
    if isinstance(rope, dict) and "type" in rope and "rope_type" not in rope:
        overrides["rope_parameters"] = {**rope, "rope_type": rope["type"]}
    return overrides


def _merge_into(target: Any, overrides: dict) -> None:
    for key, value in overrides.items():
        current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):  # a sub-config
            _merge_into(current, value)
            continue
        if isinstance(value, dict) and isinstance(current, dict):
            merged = dict(current)
            _merge_into(merged, value)
            value = merged
        if isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)
