"""``SpeculativeConfig``: speculative decoding (n-gram, draft model, EAGLE heads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pagedllm.arch_config import IMAGE_TEXT_ARCHITECTURES
from pagedllm.config.hub import load_hf_config, resolve_model_path
from pagedllm.config.model import ModelConfig, derived_max_model_len

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: ``speculative_config["method"]`` values built here (vLLM's names).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
#: vLLM's methods that are not built yet.
_SPECULATIVE_METHODS_NOT_BUILT = ("medusa", "mlp_speculator", "suffix", "mtp")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "enable_adaptive_k", "adaptive_k_ema_alpha")
#: EAGLE methods -> (architectures a head's config.json may name, the head class loaded;
#: vLLM's names, ``pagedllm.model_executor.models.llama_eagle``).
EAGLE_HEAD_ARCHITECTURES = {
    "eagle": (("LlamaForCausalLM", "EagleLlamaForCausalLM"), "EagleLlamaForCausalLM"),
    "eagle3": (("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"), "Eagle3LlamaForCausalLM"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` / ``speculative_config``).

    ``method``: ``"ngram"`` (prompt lookup over the request's own prompt and output,
    ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens long), ``"draft_model"`` (a
    smaller model with the target's vocabulary, at ``model``; implied when only ``model``
    is given, as vLLM), or ``"eagle"`` / ``"eagle3"`` (an EAGLE / EAGLE-3 head at
    ``model``, which reads the target's hidden states: Li et al. 2024, 2025).
    ``num_speculative_tokens`` (k) tokens are proposed per request and step, and verified
    by the target in one forward pass. ``draft_model_config`` is the draft's or head's
    ``ModelConfig`` (None for n-gram), and ``eagle_aux_hidden_state_layer_ids`` the
    target layers whose input an EAGLE-3 head reads, both set by
    ``EngineArgs.create_engine_config``.

    ``enable_adaptive_k`` (the key of vLLM's Adaptive K, which is off by default there; on
    here): ``num_speculative_tokens`` is the most drafts per request and step, and each
    request proposes 0 .. k of them as its measured acceptance and the measured cost of
    drafting make worthwhile (``pagedllm.core.spec_length``), ``adaptive_k_ema_alpha``
    weighting its newest step (vLLM's default 0.3). Off: always k.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    draft_model_config: Optional[ModelConfig] = None
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] = ()
    enable_adaptive_k: bool = True
    adaptive_k_ema_alpha: float = 0.3

    @property
    def prior_draft_token_cost(self) -> float:
        """One draft token's cost relative to a plain step's share per request, assumed
        until measured: a verified row (n-gram proposals are free), plus a draft forward."""
        return 0.02 if self.method == "ngram" else 0.1

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model proposes (a draft model or an EAGLE head), with its own paged KV cache."""
        return self.method != "ngram"

    @property
    def is_eagle(self) -> bool:
        return self.method in EAGLE_HEAD_ARCHITECTURES

    @classmethod
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        """Check the keys and values of a ``speculative_config`` dict (no model is read).

        n-gram lookup lengths default as in vLLM: both 5 when neither is given, else the
        missing one equals the other.

        Raises:
            ValueError: "speculative_config[KEY] ...": an unknown key, a missing or unknown
                ``method``, ``num_speculative_tokens`` missing or below 1, lookup lengths
                below 1 or min > max, ``model`` missing for a draft model or EAGLE head,
                ``enable_adaptive_k`` not a bool, ``adaptive_k_ema_alpha`` outside (0, 1].
        """
        unknown = sorted(set(config) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config[{unknown[0]!r}] is not a known key; known: {', '.join(_SPECULATIVE_KEYS)}.")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method in _SPECULATIVE_METHODS_NOT_BUILT:
            raise ValueError(f"speculative_config['method']={method!r} is not supported yet; supported: {', '.join(SPECULATIVE_METHODS)}.")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(or give 'model' for a draft model), got {method!r}.")
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an integer >= 1, got {k!r}.")
        if method != "ngram" and not config.get("model"):
            what = "an EAGLE head's" if method in EAGLE_HEAD_ARCHITECTURES else "the draft model's"
            raise ValueError(f"speculative_config['model'] ({what} path or Hub id) is required for method {method!r}.")
        lookup_min, lookup_max = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if method == "ngram":
            lookup_min = lookup_min if lookup_min is not None else (lookup_max if lookup_max is not None else 5)
            lookup_max = lookup_max if lookup_max is not None else lookup_min
            for key, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"speculative_config[{key!r}] must be an integer >= 1, got {value!r}.")
            if lookup_min > lookup_max:
                raise ValueError(f"speculative_config['prompt_lookup_min'] ({lookup_min}) must not exceed "
                                 f"'prompt_lookup_max' ({lookup_max}).")
        adaptive, ema_alpha = config.get("enable_adaptive_k", True), config.get("adaptive_k_ema_alpha", 0.3)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config['enable_adaptive_k'] must be true or false, got {adaptive!r}.")
        if isinstance(ema_alpha, bool) or not isinstance(ema_alpha, (int, float)) or not 0 < ema_alpha <= 1:
            raise ValueError(f"speculative_config['adaptive_k_ema_alpha'] must be a number in (0, 1], got {ema_alpha!r}.")
        return cls(method, k, lookup_min, lookup_max, config.get("model"),
                   enable_adaptive_k=adaptive, adaptive_k_ema_alpha=float(ema_alpha))

    def resolve_draft_model(
        self, target: ModelConfig, revision: Optional[str], download_dir: Optional[str]
    ) -> SpeculativeConfig:
        """This config with the draft model's or EAGLE head's config.json read into
        ``draft_model_config`` (the target's dtype and context length) and, for EAGLE-3, its
        ``eagle_aux_hidden_state_layer_ids``; itself for n-gram.

        Raises:
            ValueError: naming ``speculative_config['model']``: a path that is not a model, a
                vocabulary size other than the target's, or a context shorter than the
                target's ``max_model_len``; for an EAGLE head also an image-text target, an
                architecture of the other method, a hidden size other than the target's, or
                EAGLE-3 layer ids outside the target (see ``_check_eagle_head``).
        """
        if not self.uses_draft_model:
            return self
        if self.is_eagle and target.architecture in IMAGE_TEXT_ARCHITECTURES:
            raise ValueError(f"speculative_config['method']={self.method!r} is not supported yet with an image-text "
                             f"model ({target.architecture}: the head would read the image placeholders' token "
                             "embeddings, not the images'); n-gram and draft-model speculation are.")
        try:
            path = resolve_model_path(self.model, revision, download_dir)
            hf_config = load_hf_config(path, target.trust_remote_code)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config['model']={self.model!r}: {e}") from e
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config['model']={self.model!r} has a vocabulary of {hf_config.vocab_size} "
                             f"tokens, the target model {target.vocab_size}: a draft model must share the target's vocabulary.")
        if derived_max_model_len(hf_config) < target.max_model_len:
            raise ValueError(f"speculative_config['model']={self.model!r} handles {derived_max_model_len(hf_config)} "
                             f"tokens of context, fewer than max_model_len ({target.max_model_len}).")
        layer_ids = self._check_eagle_head(hf_config, target) if self.is_eagle else ()
        draft_model_config = ModelConfig(
            model=str(self.model), model_path=path, tokenizer_path=target.tokenizer_path, hf_config=hf_config,
            dtype=target.dtype, max_model_len=target.max_model_len, seed=target.seed,
            trust_remote_code=target.trust_remote_code,
        )  # fmt: skip
        return dataclasses.replace(
            self, draft_model_config=draft_model_config, eagle_aux_hidden_state_layer_ids=layer_ids
        )

    def _check_eagle_head(self, hf_config: PretrainedConfig, target: ModelConfig) -> tuple[int, ...]:
        """Check an EAGLE head against its target; name its class (vLLM's architecture
        name) in ``hf_config.architectures``; return the EAGLE-3 layer ids (() for EAGLE): the config's
        ``eagle_aux_hidden_state_layer_ids``, else vLLM's default (2, L // 2, L - 3) for a
        target of L layers; id i is the residual stream entering target layer i.

        Raises:
            ValueError: naming ``speculative_config['model']``: see ``resolve_draft_model``.
        """
        accepted, head_class = EAGLE_HEAD_ARCHITECTURES[self.method]
        name = f"speculative_config['model']={self.model!r}"
        architecture = (getattr(hf_config, "architectures", None) or ["<none>"])[0]
        if architecture not in accepted:
            raise ValueError(f"{name} is a {architecture} checkpoint; method {self.method!r} loads "
                             f"{' or '.join(accepted)} heads.")
        target_hidden = target.hf_config.hidden_size
        for key in ("hidden_size", "target_hidden_size"):
            size = getattr(hf_config, key, None)
            if size is not None and size != target_hidden:
                raise ValueError(f"{name} has {key} {size}, the target model {target_hidden}: an EAGLE head "
                                 "reads the target's hidden states and shares its embeddings.")
        hf_config.architectures = [head_class]
        if self.method != "eagle3":
            return ()
        num_layers = target.num_layers
        ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or (2, num_layers // 2, num_layers - 3)
        if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
            raise ValueError(f"{name}: eagle_aux_hidden_state_layer_ids {list(ids)} must be 3 layer ids of the "
                             f"target's {num_layers} layers (0 .. {num_layers - 1}); the default is (2, L // 2, L - 3).")
        return tuple(ids)
