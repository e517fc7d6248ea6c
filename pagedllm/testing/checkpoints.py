"""Checkpoints the project makes itself: a byte-level BPE tokenizer trained offline and
random-initialised Hugging Face models saved in the usual on-disk layout.

Nothing here downloads anything. The tokenizer is trained on text that ships with Python
(standard-library docstrings, plus standard-library source for large vocabularies) and a
few hundred characters of emoji / CJK text, so that multi-byte UTF-8 characters are
covered and often split over several byte tokens (which exercises incremental
detokenization).

Typical use::

    from pagedllm.testing.checkpoints import build_tokenizer, make_checkpoint

    tok = build_tokenizer()                       # 1024 tokens, cached per process
    path = make_checkpoint(tmp_dir, "Qwen2ForCausalLM")
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SUPPORTED_ARCHS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "make_checkpoint",
]

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Special tokens, in id order: they get ids 0, 1, 2 in every tokenizer built here.
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

#: ChatML, as Qwen uses it. ``content`` may be a string or a list of OpenAI-style content
#: parts (only the ``text`` parts are rendered).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SUPPORTED_ARCHS = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)

# Vocabularies above this size also train on standard-library source code: docstrings alone
# (~0.8 MB) run out of merges at about 16k tokens.
_SOURCE_CORPUS_MIN_VOCAB = 4096

# Multilingual and emoji text, so these characters are in the training data. Each one is
# rare, so most of them stay split over two to four byte-level tokens.
_UNICODE_TEXT = (
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。",
    "分页注意力把键值缓存切成固定大小的块，就像操作系统的虚拟内存一样。",
    "こんにちは、世界。東京は日本の首都です。猫が好きですか？ひらがなとカタカナ。",
    "안녕하세요, 세계! 한국어 텍스트도 조금 있습니다. 감사합니다.",
    "Emoji: 😀 😃 😄 😁 😆 😅 😂 🤣 😊 😇 🙂 🙃 😉 😌 😍 🥰 😘 🚀 🔥 ✨ 🎉 👍 👋 🙏 "
    "❤️ 💡 📚 🐍 🦀 🌍 🌸 🍣 🍜 ☕ 🎵 ⚡ ✅ ❌ 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 🇨🇳",
    "Mixed: the cat 🐱 sat on the mat 🧶; 猫は座った; 고양이가 앉았다. Ünïcödé façade café naïve.",
    "".join(chr(c) for c in range(0x1F600, 0x1F650)),
    "".join(chr(0x4E00 + (i * 97) % 0x5000) for i in range(120)),
)

_TOKENIZER_CACHE: dict[int, str] = {}
_TOKENIZER_LOCK = threading.Lock()


def _training_texts(vocab_size: int) -> list[str]:
    script = Path(__file__).with_name("tokenizer_corpus.py")
    sources = ["--sources"] if vocab_size > _SOURCE_CORPUS_MIN_VOCAB else []
    done = subprocess.run([sys.executable, "-I", "-S", str(script), *sources], capture_output=True, check=True)
    texts = json.loads(done.stdout)
    # The unicode lines go in a few times, so they are not drowned out entirely.
    texts += list(_UNICODE_TEXT) * 3
    return texts


# Qwen2's pre-tokenizer regex (digits one by one, punctuation runs, newline runs). The
# tokenizer uses Qwen2's exact pipeline (NFC, this split, byte-level) because transformers
# 5 rebuilds that pipeline for ``model_type`` qwen2 checkpoints regardless of
# tokenizer.json; with the same pipeline every loader tokenizes identically.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _train_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(vocab_size), trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = 1024, *, cache: bool = True):
    """Train (or fetch from the per-process cache) a byte-level BPE tokenizer.

    Args:
        vocab_size: the number of tokens wanted, special tokens included. 1024 trains in
            well under a second from standard-library docstrings; larger sizes also use
            standard-library source code (about 4 MB, enough for 32000; a size the text
            cannot fill gives a smaller vocabulary: check ``len(tokenizer)``).
        cache: reuse the result of an earlier call with the same ``vocab_size`` in this
            process. ``False`` always trains afresh (for determinism tests).

    Returns:
        A new ``transformers.PreTrainedTokenizerFast`` on every call (so callers may
        change ``padding_side`` and so on without affecting each other). Training is
        deterministic: the same Python version gives the same vocabulary and merges.
        Special tokens: ``<|endoftext|>`` id 0 (eos, pad, and bos; a bos is never added
        automatically), ``<|im_start|>`` id 1, ``<|im_end|>`` id 2. The chat template is
        ChatML (:data:`CHAT_TEMPLATE`).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    with _TOKENIZER_LOCK:
        data = _TOKENIZER_CACHE.get(vocab_size) if cache else None
        if data is None:
            data = _train_tokenizer_json(vocab_size)
            if cache:
                _TOKENIZER_CACHE[vocab_size] = data
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(data),
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------

# Init scales (see make_checkpoint's docstring for why they are this large).
_LINEAR_GAIN = 1.0  # std = gain / sqrt(fan_in): activations stay O(1)
_QK_GAIN = 1.5  # q/k projections: attention scores with std ~2, so attention is peaked
_OUT_GAIN = 8.0  # o_proj / down_proj: layer outputs dominate the residual stream (tied models)
_EMBED_STD = 8.0  # untied input embeddings: the same scale as the layer outputs
_LM_HEAD_GAIN = 6.0  # logits with std ~6: greedy argmax well separated (tied: final norm)
_BIAS_STD = 0.2  # Qwen2's q/k/v biases: clearly non-zero; larger ones make outputs repetitive
_NORM_RANGE = (0.5, 1.5)  # RMSNorm weights (incl. Qwen3 q_norm / k_norm): uniform, not ones


def _build_config(arch: str, **kwargs):
    import transformers

    config_classes = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "MistralForCausalLM": transformers.MistralConfig,
    }
    if arch not in config_classes:
        raise ValueError(f"unsupported arch {arch!r}; choose one of {SUPPORTED_ARCHS}")
    return config_classes[arch](**kwargs)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter from our own seeded generator (see make_checkpoint)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    final_norm = "model.norm.weight"
    for name, param in model.named_parameters():  # tied lm_head is reported once, as embed
        # Draw in float32 and copy in chunks: the values do not depend on the target dtype
        # and peak extra memory stays small for big models.
        flat = param.view(-1)
        if param.dim() == 1:
            low, high = _NORM_RANGE
            std = None
        elif name.endswith("embed_tokens.weight"):
            # Tied: unit-norm rows; the final norm's weights carry the LM-head gain instead
            # (see below), so the token's own embedding, left in the residual stream, is
            # small next to the layer outputs and does not make the model repeat its input.
            std = 1.0 / math.sqrt(param.shape[1]) if tied else _EMBED_STD
        elif name.endswith("lm_head.weight"):
            std = _LM_HEAD_GAIN / math.sqrt(param.shape[1])
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            std = _QK_GAIN / math.sqrt(param.shape[1])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            std = _OUT_GAIN / math.sqrt(param.shape[1])
        else:
            std = _LINEAR_GAIN / math.sqrt(param.shape[1])
        chunk = 1 << 22
        for start in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - start)
            if param.dim() == 1 and name.endswith(".bias"):
                vals = torch.randn(n, generator=gen) * _BIAS_STD
            elif param.dim() == 1:
                vals = torch.rand(n, generator=gen) * (high - low) + low
                if tied and name == final_norm:
                    vals *= _LM_HEAD_GAIN
            else:
                vals = torch.randn(n, generator=gen) * std
            flat[start : start + n].copy_(vals)


def _legacy_config_keys(config_path: Path, rope_theta: float, rope_scaling, dtype) -> None:
    """Add the keys most published checkpoints carry (transformers 4.x layout) next to the
    ones transformers 5 writes (``rope_parameters``, ``dtype``), so loaders of either
    generation read them."""
    cfg = json.loads(config_path.read_text())
    cfg.setdefault("rope_theta", rope_theta)
    cfg["rope_scaling"] = dict(rope_scaling) if rope_scaling is not None else None
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    cfg.setdefault("dtype", cfg["torch_dtype"])
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    """tokenizer.json plus a tokenizer_config.json in the layout published checkpoints use
    (``PreTrainedTokenizerFast``, ``added_tokens_decoder``, ``chat_template`` inline), so it
    loads with transformers 4.x and 5.x alike."""
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok_id): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for tok_id, tok in sorted(tokenizer.added_tokens_decoder.items())
    }
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": tokenizer.model_max_length,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def make_checkpoint(
    out_dir: str | os.PathLike,
    arch: str,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    head_dim: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_vocab_size: int = 1024,
    max_shard_size: int | str | None = None,
    **extra_config: Any,
) -> Path:
    """Write a random-initialised Hugging Face checkpoint to ``out_dir`` and return its path.

    Args:
        out_dir: the folder to write (created if missing).
        arch: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
            ``MistralForCausalLM``.
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        intermediate_size, head_dim, max_position_embeddings, tie_word_embeddings,
        rope_theta: the usual config fields. ``head_dim`` None means
            ``hidden_size // num_attention_heads``.
        vocab_size: the model's vocabulary; None means ``len(tokenizer)``. It may be larger
            than the tokenizer (as in real checkpoints, padded vocabularies), not smaller.
        rope_scaling: e.g. ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}``.
        dtype: the dtype weights are created and saved in (float32, bfloat16, float16).
        seed: all weights come from a generator seeded with this; the same arguments give
            the same files (for one Python/transformers version).
        tokenizer_vocab_size: passed to :func:`build_tokenizer`.
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"200KB"``) to get several
            ``model-0000x-of-0000n.safetensors`` files and ``model.safetensors.index.json``;
            None writes a single ``model.safetensors``.
        **extra_config: any other config field (``sliding_window``, ``rms_norm_eps`` ...).

    Returns:
        ``Path(out_dir)``, holding ``config.json``, the safetensors weights,
        ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (with the
        ChatML chat template inline) and ``special_tokens_map.json``. ``config.json`` has
        both transformers-5 keys (``rope_parameters``, ``dtype``) and the 4.x keys most
        published checkpoints carry (``rope_theta``, ``rope_scaling``, ``torch_dtype``).
        bos, eos and pad ids are all ``<|endoftext|>`` (0).

    Why the init is not Hugging Face's: HF initialises with std 0.02, which gives almost
    flat logits, so the greedy argmax is decided by differences near rounding noise and
    two correct engines may disagree; and the output is usually one token repeated, so a
    test comparing outputs would not notice most bugs. Here (all from one generator
    seeded with ``seed``):

    - linear weights have std ``gain / sqrt(fan_in)``: gain 1 for gate/up/v, 1.5 for
      q/k (attention is peaked and depends on the tokens), 8 for o_proj/down_proj (layer
      outputs dominate the residual stream);
    - logits have std ~6 (median top-1 / top-2 gap above 1 logit on the tiny models);
    - untied embeddings have std 8. Tied models get unit-norm embedding rows and the
      final norm carries the LM-head gain instead: otherwise the current token's own
      embedding, left in the residual stream, scores highest and the model repeats it;
    - biases are N(0, 0.2) (Qwen2's q/k/v biases matter; much larger ones make the
      output repetitive);
    - every RMSNorm weight, Qwen3's q_norm/k_norm included, is uniform in [0.5, 1.5]
      rather than ones, so a missing or misplaced norm changes the output.

    Greedy outputs of the tiny models vary with the prompt and rarely repeat; the test
    suite checks this (tests/testing/test_checkpoints.py).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(tokenizer_vocab_size)
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {len(tokenizer)}")

    config_kwargs: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
        config_kwargs["rope_scaling"] = dict(rope_scaling)  # transformers edits it in place
    if head_dim is not None:
        config_kwargs["head_dim"] = head_dim
    if arch == "MistralForCausalLM":
        config_kwargs["sliding_window"] = None  # as Mistral v0.2+; pass it to test windows
    config_kwargs.update(extra_config)
    config = _build_config(arch, **config_kwargs)
    config.architectures = [arch]

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if tie_word_embeddings:
        model.tie_weights()
    _init_weights(model, seed)
    model.eval()

    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    _legacy_config_keys(out / "config.json", rope_theta, rope_scaling, dtype)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    return out
