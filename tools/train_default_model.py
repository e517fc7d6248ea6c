#!/usr/bin/env python3
"""Train ``pagedllm-default``, the small model that ships inside the pagedllm package.

The model is a Llama-architecture causal LM of a few million parameters with its own
byte-level BPE tokenizer, trained with plain PyTorch on CPU, seeded so that a rerun on the
same machine, Python and torch reproduces the checkpoint.

Training text: the documentation that ships with every CPython installation, so it is
available offline everywhere and needs no download:

* the docstrings of the Python standard library modules (parsed with :mod:`ast`, never
  imported), and
* ``pydoc_data.topics``, the language-reference pages behind ``help("if")`` and friends.

Both are (c) Python Software Foundation and licensed under the PSF License Version 2, which
permits redistribution of derived works provided the PSF copyright notice and the licence
are retained (the model card does). A share of the docstrings is wrapped as ChatML
conversations ("What does json.dumps do?" -> docstring), so the model also answers through
the chat template.

Held-out data: whole source units (a stdlib module or a pydoc topic) are held out by a hash
of their name, so no held-out document shares a module with training text. The script
reports the model's held-out perplexity and that of an add-one-smoothed unigram model
estimated on the train split, on exactly the same held-out target tokens.

Output (Hugging Face layout): config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json (with a ChatML chat template) and README.md (model
card). Retrain the shipped model with::

    .venv/bin/python tools/train_default_model.py

The held-out documents as plain text, for ``pagedllm bench perplexity`` (no training)::

    .venv/bin/python tools/train_default_model.py --write-heldout-text /tmp/heldout.txt

A miniature run for tests, e.g.::

    .venv/bin/python tools/train_default_model.py --out /tmp/mini --steps 20 \\
        --hidden-size 64 --num-layers 2 --vocab-size 512 --max-chars 200000 --seq-len 64
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import platform
import random
import re
import shlex
import sys
import sysconfig
import time
from typing import Iterator, Sequence

DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "pagedllm" / "assets" / "pagedllm-default"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2

#: ChatML; with ``tools``, Hermes-style tool calling (as Qwen 2.5's template): the tools
#: in a system block, an assistant's ``tool_calls`` as ``<tool_call>`` JSON blocks, and
#: consecutive ``tool`` messages as one user turn of ``<tool_response>`` blocks. A
#: conversation without tools renders as plain ChatML (``render_chat``).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- (messages[0]['content'] or '') + '\n\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(TOOLS_INSTRUCTION) + " + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] or [] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{%- set arguments = call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) %}"
    "{{- '\n<tool_call>\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' + arguments + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

ROPE_THETA = 10000.0
SYSTEM_PROMPT = "You are a helpful assistant that explains Python."
QUESTION_TEMPLATES = (
    "What does {name} do?",
    "Explain {name}.",
    "What is {name}?",
    "Describe {name}.",
    "Tell me about {name}.",
)
TOPIC_QUESTION_TEMPLATES = (
    "Explain the Python topic '{name}'.",
    "Tell me about '{name}' in Python.",
    "What is '{name}' in Python?",
)

SAMPLE_PROMPTS = (
    "Return the number of",
    "This module provides",
    "The default value is",
)
SAMPLE_CHAT = "What does os.path.join do?"

PSF_NOTICE = (
    "Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved. "
    "Licensed under the PSF License Agreement for Python (PSF License Version 2)."
)


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    """One training document: ``unit`` decides the train/held-out split, ``name`` is what a
    chat question asks about, ``kind`` is ``"docstring"`` or ``"topic"``."""

    unit: str
    name: str
    kind: str
    text: str


_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _module_name(path: pathlib.Path) -> str:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def clean_text(text: str) -> str | None:
    """Keep prose paragraphs of a docstring; drop doctests, grammar rules and symbol-heavy
    (code-like) paragraphs. Returns None if nothing useful is left."""
    keep = []
    for para in re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\t", "    ")):
        lines = [line.rstrip() for line in para.strip("\n").split("\n")]
        para = "\n".join(lines).strip()
        if not para:
            continue
        if any(line.lstrip().startswith((">>>", "...", "$ ")) for line in lines) or "::=" in para:
            continue
        if len(para) >= 8 and set(para.replace("\n", "")) <= set("*=-~^#+ "):
            continue  # rst underline
        letters = sum(ch.isalpha() or ch == " " for ch in para)
        if letters < 0.8 * len(para):
            continue
        keep.append(para)
    out = "\n\n".join(keep).strip()
    return out if len(out) >= 20 else None


def _docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    doc = ast.get_docstring(tree)
    if doc:
        yield module, doc

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                d = ast.get_docstring(child)
                if d:
                    yield name, d
                yield from visit(child, name)

    yield from visit(tree, module)


def collect_documents(max_chars: int | None = None) -> list[Document]:
    """All training documents, in a fixed order: pydoc topics first, then the stdlib
    docstrings file by file. ``max_chars`` stops early (for miniature test runs)."""
    docs: list[Document] = []
    total = 0

    def add(doc: Document) -> bool:
        nonlocal total
        docs.append(doc)
        total += len(doc.text)
        return max_chars is not None and total >= max_chars

    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it; the docstrings are enough
        topics = {}
    for key in sorted(topics):
        text = clean_text(topics[key])
        if text and add(Document(f"topic:{key}", key, "topic", text)):
            return docs
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = _module_name(path)
        for name, raw in _docstrings(tree, module):
            text = clean_text(raw)
            if text and add(Document(f"module:{module}", name, "docstring", text)):
                return docs
    return docs


def is_heldout(unit: str, heldout_percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(unit.encode()).digest()[:8], "big")
    return (h % 10_000) < heldout_percent * 100


def heldout_plain_text(heldout_percent: float) -> str:
    """The held-out documents as plain text (no ChatML wrapping, no special tokens), joined
    by blank lines: prose the model was never trained on, for perplexity measurements. The
    same CPython version gives the same text."""
    docs = [d for d in collect_documents() if is_heldout(d.unit, heldout_percent)]
    return "\n\n".join(d.text for d in docs) + "\n"


def render_chat(messages: Sequence[dict]) -> str:
    """Exactly what CHAT_TEMPLATE renders for messages without tools (and no generation prompt)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def format_documents(docs: Sequence[Document], chat_fraction: float, seed: int) -> list[str]:
    """Turn documents into training strings; a seeded share becomes ChatML conversations."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        if rng.random() < chat_fraction:
            templates = TOPIC_QUESTION_TEMPLATES if doc.kind == "topic" else QUESTION_TEMPLATES
            question = rng.choice(templates).format(name=doc.name)
            messages = []
            if rng.random() < 0.5:
                messages.append({"role": "system", "content": SYSTEM_PROMPT})
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": doc.text})
            out.append(render_chat(messages))
        else:
            out.append(doc.text)
    return out


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) with the three special tokens at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=0,  # set by the caller
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_stream(tok, texts: Sequence[str]) -> list[int]:
    """Token ids of all texts, each followed by <|endoftext|>."""
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return ids


# --------------------------------------------------------------------------------------
# Model, training, evaluation
# --------------------------------------------------------------------------------------


def build_config(args, vocab_size: int):
    from transformers import LlamaConfig

    intermediate = args.intermediate_size or int(round(args.hidden_size * 2.75 / 16)) * 16
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=True,
    )


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (step is 0-based)."""
    warmup = min(args.warmup_steps, max(1, args.steps // 10))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def batches(ids, seq_len: int, batch_size: int, seed: int, copy: "CopyExercises | None" = None):
    """Endless seeded stream of ``(windows, labels)``: windows [batch, seq_len + 1] token
    ids, labels [batch, seq_len] (the next token of each position, -100 where no loss is
    taken). Each epoch starts at a new random offset and visits the windows in a new random
    order; with ``copy``, a share of the rows is replaced by copying exercises."""
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    span = seq_len + 1
    if len(data) < span + seq_len:
        raise ValueError(f"only {len(data)} training tokens; need more than {2 * seq_len + 1}")
    while True:
        offset = int(torch.randint(0, seq_len, (1,), generator=gen))
        n = (len(data) - offset) // span
        windows = data[offset : offset + n * span].view(n, span)
        order = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):
            batch = windows[order[i : i + batch_size]].clone()
            labels = batch[:, 1:].clone()
            if copy is not None:
                copy.apply(batch, labels, data, gen)
            yield batch, labels


@dataclasses.dataclass(frozen=True)
class CopyExercises:
    """Copying exercises mixed into training, so that the model learns to continue a passage
    it has already read (induction heads: Olsson et al. 2022, "In-context Learning and
    Induction Heads"). That is what n-gram speculation (prompt lookup) relies on when a
    request quotes, repeats or edits its prompt.

    A chosen row becomes: natural text, a passage ``S``, ``sep`` (a blank line), ``S`` again
    (2 to ``max_copies`` copies in all, separated by ``sep``, ``S`` of 16 tokens up to what
    fits in the window), then natural text to the end of the window.
    Half of the passages are training text, half are uniformly random tokens, which only
    copying can predict; a random passage's first occurrence (and the blank line after it)
    is left out of the loss, being noise. Fresh exercises are drawn for every batch, so
    none is memorised.

    Attributes:
        fraction: share of the rows of each batch replaced, in [0, 1].
        sep: token ids of the blank line between copies.
        first_token: smallest id a random passage uses (after the special tokens).
        vocab_size: random passages use ids in [first_token, vocab_size).
        max_copies: most copies of a passage in one row (at least 2).
    """

    fraction: float
    sep: tuple[int, ...]
    first_token: int
    vocab_size: int
    max_copies: int = 2

    def apply(self, batch, labels, data, gen) -> None:
        """Rewrite a seeded share of the rows of ``batch`` [B, span] and ``labels``
        [B, span - 1] in place; ``data`` is the training stream (1-D int64)."""
        import torch

        span = batch.size(1)
        sep = torch.tensor(self.sep, dtype=torch.long)
        chosen = torch.rand(batch.size(0), generator=gen) < self.fraction
        for row in chosen.nonzero().flatten().tolist():
            copies = int(torch.randint(2, self.max_copies + 1, (1,), generator=gen))
            max_len = (span - (copies - 1) * len(sep)) // copies
            length = int(torch.randint(16, max(16, max_len) + 1, (1,), generator=gen))
            if bool(torch.rand(1, generator=gen) < 0.5):
                passage = torch.randint(self.first_token, self.vocab_size, (length,), generator=gen)
                random_passage = True
            else:
                at = int(torch.randint(0, len(data) - length, (1,), generator=gen))
                passage = data[at : at + length]
                random_passage = False
            exercise = torch.cat([passage] + [torch.cat([sep, passage]) for _ in range(copies - 1)])[:span]
            start = int(torch.randint(0, span - len(exercise) + 1, (1,), generator=gen))
            batch[row, start : start + len(exercise)] = exercise
            labels[row] = batch[row, 1:]
            if random_passage:
                # targets inside the first copy and the blank line after it: noise
                labels[row, max(0, start - 1) : start + length + len(sep) - 1] = -100


def heldout_windows(ids, seq_len: int):
    """Non-overlapping [n, seq_len + 1] windows of the held-out stream (the last partial
    window is kept, shorter)."""
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    span = seq_len + 1
    out = [data[i : i + span] for i in range(0, max(1, len(data) - 1), seq_len)]
    return [w for w in out if len(w) >= 2]


def evaluate(model, windows, max_windows: int | None = None, batch_size: int = 16) -> tuple[float, int]:
    """Mean held-out negative log-likelihood (nats per token, float32) and token count.
    Every window predicts tokens 1..len-1 from the preceding ones."""
    import torch

    windows = windows[:max_windows] if max_windows else windows
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(windows), batch_size):
            group = windows[i : i + batch_size]
            for length in sorted({len(w) for w in group}):
                same = torch.stack([w for w in group if len(w) == length])
                logits = model(input_ids=same[:, :-1]).logits.float()
                nll = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), same[:, 1:].reshape(-1), reduction="sum"
                )
                total += float(nll)
                count += same[:, 1:].numel()
    model.train(was_training)
    return total / max(1, count), count


def copy_accuracy(model, heldout_ids: Sequence[int], sep: Sequence[int], length: int = 120,
                  num: int = 32, cue: int = 8) -> float:
    """How well the model continues a passage it has read: ``num`` held-out passages of
    ``length`` tokens (consecutive, non-overlapping), each fed as passage + ``sep`` +
    passage; the share of the second copy's tokens after its first ``cue`` that are the
    model's top-1 prediction (teacher-forced). 1.0 is perfect copying."""
    import torch

    was_training = model.training
    model.eval()
    sep_t = torch.tensor(list(sep), dtype=torch.long)
    data = torch.tensor(list(heldout_ids), dtype=torch.long)
    rows = [data[i * length : (i + 1) * length] for i in range(min(num, len(data) // length))]
    batch = torch.stack([torch.cat([r, sep_t, r]) for r in rows])
    start = length + len(sep) + cue
    with torch.inference_mode():
        logits = model(input_ids=batch[:, :-1]).logits
    hits = logits[:, start - 1 :].argmax(-1) == batch[:, start:]
    model.train(was_training)
    return float(hits.float().mean())


def unigram_nll(train_ids: Sequence[int], windows, vocab_size: int) -> float:
    """Mean NLL of an add-one-smoothed unigram model (counts from the train split) on the
    same held-out target tokens that :func:`evaluate` scores."""
    import torch

    counts = torch.bincount(torch.tensor(train_ids, dtype=torch.long), minlength=vocab_size).double()
    logp = torch.log((counts + 1) / (counts.sum() + vocab_size))
    targets = torch.cat([w[1:] for w in windows])
    return float(-logp[targets].mean())


def generate_samples(model, hf_tok, max_new_tokens: int = 48) -> list[tuple[str, str]]:
    """Greedy continuations of SAMPLE_PROMPTS and one chat answer, as (prompt, output)."""
    import torch

    samples = []
    prompts = [(p, p) for p in SAMPLE_PROMPTS]
    chat_prompt = hf_tok.apply_chat_template(
        [{"role": "user", "content": SAMPLE_CHAT}], tokenize=False, add_generation_prompt=True
    )
    prompts.append((f"[chat] user: {SAMPLE_CHAT}", chat_prompt))
    model.eval()
    with torch.inference_mode():
        for shown, text in prompts:
            ids = torch.tensor([hf_tok(text, add_special_tokens=False)["input_ids"]])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=[hf_tok.convert_tokens_to_ids(IM_END), hf_tok.convert_tokens_to_ids(ENDOFTEXT)],
                pad_token_id=hf_tok.convert_tokens_to_ids(ENDOFTEXT),
            )
            samples.append((shown, hf_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    return samples


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def _base_training(card: str) -> dict:
    """The "Training" section (before its retrain commands) and the retrain commands of the
    model card of an ``--init-from`` checkpoint, to be carried into the new card; paths inside
    the repository are made relative to it (the commands run from its root)."""
    training = card.split("## Training\n", 1)[1]
    commands = re.search(r"```bash\n(.*?)```", training, flags=re.S).group(1).strip()
    root = str(pathlib.Path(__file__).resolve().parents[1]) + "/"
    return {"training": training.split("\nRetrain", 1)[0].strip(), "command": commands.replace(root, "")}


def retrain_command(argv: Sequence[str]) -> str:
    return " ".join([".venv/bin/python", "tools/train_default_model.py", *map(shlex.quote, argv)])


def write_model_card(out: pathlib.Path, info: dict) -> None:
    samples = "\n".join(
        f"{i}. prompt: `{p}`\n\n   ```text\n" + "\n".join("   " + line for line in o.strip().splitlines()) + "\n   ```\n"
        for i, (p, o) in enumerate(info["samples"], 1)
    )
    cfg = info["config"]
    copying = ""
    if info["copy_fraction"] > 0:
        copying = (
            f" {info['copy_fraction']:.0%} of the windows held a copying exercise (a passage, a blank line and the "
            f"passage again, {info['copy_max_copies']} copies at most; half of the passages training text, half "
            "random tokens, drawn fresh for each batch), so that the model continues a passage it has read: "
            "what prompt-lookup (n-gram) speculation needs."
        )
    base = ""
    if info["base"]:
        base = info["base"]["training"] + "\n\nThen `--init-from` continued training that checkpoint:\n"
    card = f"""---
license: apache-2.0
language: en
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, pagedllm]
---

# pagedllm-default

The small model that ships inside the `pagedllm` package, so that `pagedllm serve` and
`LLM()` work with no download. It is a demo and a test fixture, not a useful assistant:
it writes text that reads like Python documentation.

## Model

- Architecture: `LlamaForCausalLM`, {cfg['num_hidden_layers']} layers, hidden size {cfg['hidden_size']},
  MLP {cfg['intermediate_size']}, {cfg['num_attention_heads']} attention heads / {cfg['num_key_value_heads']} KV heads
  (head dim {cfg['head_dim']}), RoPE θ {info['rope_theta']:g}, tied input/output embeddings,
  max_position_embeddings {cfg['max_position_embeddings']} (trained on {info['seq_len']}-token windows).
- Parameters: **{info['num_params']:,}** ({info['num_params'] / 1e6:.2f} M).
- Weights: `model.safetensors`, {info['dtype']}, **{info['weights_mb']:.1f} MB**
  (whole directory {info['dir_mb']:.1f} MB). The output projection is tied to `model.embed_tokens.weight`,
  so the file has no `lm_head.weight`.
- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {cfg['vocab_size']}, trained on the train split.
  Special tokens: `<|endoftext|>` (0, document end, padding), `<|im_start|>` (1), `<|im_end|>` (2, end of turn).
  No BOS token is added.
- Chat template: ChatML — `<|im_start|>role\\ncontent<|im_end|>\\n` per message, generation prompt
  `<|im_start|>assistant\\n`; with `tools`, Hermes-style tool calling (the tools in a system block,
  calls as `<tool_call>` JSON, tool results as `<tool_response>`; `pagedllm serve
  --tool-call-parser hermes`). The model was not trained on tools: use `tool_choice: "required"`
  or a named function, which constrain its output. Generation stops at `<|im_end|>` or `<|endoftext|>`
  (`generation_config.json`: `eos_token_id` {info['eos_token_ids']}).

## Training data and licence

Text that ships with CPython {info['python_version']} itself, so it is available offline:
the docstrings of the standard-library modules (parsed with `ast`; test packages excluded) and
`pydoc_data.topics` (the language-reference pages behind `help()`), with doctests, grammar rules
and code-like paragraphs removed. {info['chat_fraction']:.0%} of the documents are wrapped as ChatML
conversations (a question naming the function, class, module or topic, answered by its docstring).

- Documents: {info['num_docs']:,} ({info['num_chars']:,} characters); train {info['train_tokens']:,} tokens,
  held-out {info['heldout_tokens']:,} tokens. Held-out split: whole modules / topics chosen by a hash of
  their name ({info['heldout_percent']:g} %).
- Licence of the training text: Python Software Foundation License Version 2 (PSF-2.0), which permits
  use, modification and redistribution of derived works provided the notice is retained:
  "{PSF_NOTICE}"
- Model weights and tokenizer: Apache-2.0, like pagedllm.

## Evaluation (held-out split, same target tokens for both)

Non-overlapping windows of {info['seq_len'] + 1} tokens of the held-out stream, every token after the first
scored given the ones before it in its window.

| model | held-out perplexity |
| --- | --- |
| pagedllm-default | **{info['heldout_ppl']:.2f}** |
| unigram (add-one-smoothed token frequencies of the train split) | {info['unigram_ppl']:.2f} |

held-out perplexity: {info['heldout_ppl']:.2f}; unigram perplexity: {info['unigram_ppl']:.2f}
({info['unigram_ppl'] / info['heldout_ppl']:.1f}× lower). Held-out tokens scored: {info['heldout_scored']:,}.

Copying: fed 32 held-out passages of 120 tokens as passage + blank line + passage, the model's top-1
prediction is the passage's next token for **{info['copy_accuracy']:.1%}** of the second copy's tokens
(after its first 8).

## Sample generations (greedy, transformers)

{samples}
## Training

{base}Plain PyTorch + `transformers.LlamaForCausalLM`: AdamW (β {info['betas']}, weight decay {info['weight_decay']}),
peak LR {info['lr']:g} with {info['warmup_steps']} warm-up steps and cosine decay to {info['min_lr_ratio']:g}×,
gradient clipping 1.0, batch {info['batch_size']} × {info['seq_len']} tokens, {info['steps']} steps
({info['tokens_seen']:,} tokens, {info['epochs']:.1f} epochs), {info['autocast']} autocast, {info['threads']} CPU thread(s), seed {info['seed']}.{copying}
Final train loss {info['final_train_loss']:.3f}. Wall time {info['train_seconds'] / 60:.1f} min training
({info['total_seconds'] / 60:.1f} min in all) on {info['machine']}, Python {info['python_version']},
torch {info['torch_version']}, transformers {info['transformers_version']}, tokenizers {info['tokenizers_version']}.

Retrain (from the repository root; the same Python, torch and thread count reproduce the checkpoint{'; the commands in order' if info['base'] else ''}):

```bash
{info['retrain_command']}
```
"""
    (out / "README.md").write_text(card, encoding="utf-8")


def dir_size_mb(path: pathlib.Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 1e6


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="output directory (HF layout)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=0, help="0: 2.75 × hidden, rounded to 16")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps the run reproducible)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast for training")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-chars", type=int, default=0, help="use only the first N characters of text (0: all)")
    p.add_argument("--heldout-percent", type=float, default=5.0)
    p.add_argument("--chat-fraction", type=float, default=0.3)
    p.add_argument("--init-from", type=pathlib.Path, default=None, metavar="DIR",
                   help="continue training the checkpoint in DIR (written by this script) with its tokenizer; "
                   "the architecture options are then ignored")
    p.add_argument("--copy-fraction", type=float, default=0.0, help="share of rows that are copying exercises")
    p.add_argument("--copy-max-copies", type=int, default=2, help="most copies of a passage in one exercise")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (0: only at the end)")
    p.add_argument("--eval-windows", type=int, default=32, help="windows used for the periodic held-out loss")
    p.add_argument("--no-samples", action="store_true", help="skip sample generations")
    p.add_argument("--write-heldout-text", type=pathlib.Path, default=None, metavar="PATH",
                   help="only write the held-out documents' plain text to PATH (for `pagedllm bench perplexity`) and exit")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Train, evaluate and save; returns the run summary (also used by the model card)."""
    args = parse_args(argv)
    if args.write_heldout_text is not None:
        text = heldout_plain_text(args.heldout_percent)
        args.write_heldout_text.write_text(text, encoding="utf-8")
        print(f"wrote {len(text):,} characters of held-out text to {args.write_heldout_text}")
        return {}
    t_start = time.time()

    import tokenizers
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    docs = collect_documents(args.max_chars or None)
    texts = format_documents(docs, args.chat_fraction, args.seed)
    train_texts = [t for d, t in zip(docs, texts) if not is_heldout(d.unit, args.heldout_percent)]
    heldout_texts = [t for d, t in zip(docs, texts) if is_heldout(d.unit, args.heldout_percent)]
    if not heldout_texts:  # tiny --max-chars runs: hold out the last documents instead
        cut = max(1, len(texts) // 20)
        train_texts, heldout_texts = texts[:-cut], texts[-cut:]
    num_chars = sum(len(d.text) for d in docs)
    log(f"{len(docs)} documents, {num_chars:,} chars; {len(train_texts)} train / {len(heldout_texts)} held-out")

    if args.init_from is not None:
        tok = tokenizers.Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
        base = _base_training((args.init_from / "README.md").read_text(encoding="utf-8"))
    else:
        tok = train_tokenizer(train_texts, args.vocab_size)
        base = None
    vocab_size = tok.get_vocab_size()
    train_ids = encode_stream(tok, train_texts)
    heldout_ids = encode_stream(tok, heldout_texts)
    log(f"tokenizer: vocab {vocab_size}; train {len(train_ids):,} tokens, held-out {len(heldout_ids):,} tokens")

    if args.init_from is not None:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        log(f"initialised from {args.init_from}")
    else:
        model = LlamaForCausalLM(build_config(args, vocab_size))
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params:,} parameters")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    betas = (0.9, 0.95)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=betas,
        eps=1e-8,
    )
    windows = heldout_windows(heldout_ids, args.seq_len)
    sep = tuple(tok.encode("\n\n", add_special_tokens=False).ids)
    copy = CopyExercises(args.copy_fraction, sep, len(SPECIAL_TOKENS), vocab_size, args.copy_max_copies) if args.copy_fraction > 0 else None
    stream = batches(train_ids, args.seq_len, args.batch_size, args.seed, copy)

    losses: list[float] = []
    t_train = time.time()
    for step in range(args.steps):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch, labels = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab_size), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            elapsed = time.time() - t_train
            tok_s = (step + 1) * args.batch_size * args.seq_len / elapsed
            log(f"step {step + 1:5d}/{args.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  {tok_s:,.0f} tok/s")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 != args.steps:
            nll, _ = evaluate(model, windows, args.eval_windows)
            copy_acc = copy_accuracy(model, heldout_ids, sep)
            log(f"step {step + 1:5d}  held-out loss {nll:.4f}  ppl {math.exp(nll):.2f} (first {args.eval_windows} windows)"
                f"  copy accuracy {copy_acc:.3f}")
    train_seconds = time.time() - t_train

    model.eval()
    nll, scored = evaluate(model, windows)
    uni = unigram_nll(train_ids, windows, vocab_size)
    copy_acc = copy_accuracy(model, heldout_ids, sep)
    log(f"held-out copy accuracy {copy_acc:.3f}")
    log(f"held-out: loss {nll:.4f} ppl {math.exp(nll):.2f}; unigram ppl {math.exp(uni):.2f} ({scored:,} tokens)")

    # Save in Hugging Face layout.
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "chat_template.jinja", "special_tokens_map.json", "pytorch_model.bin"):
        (out / stale).unlink(missing_ok=True)
    save_dtype = getattr(torch, args.save_dtype)
    model.to(save_dtype)
    model.config.dtype = args.save_dtype
    model.save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    _normalise_config(out)
    eos_ids = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    gen_cfg = {
        "bos_token_id": tok.token_to_id(ENDOFTEXT),
        "eos_token_id": eos_ids,
        "pad_token_id": tok.token_to_id(ENDOFTEXT),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    hf_tok = wrap_tokenizer(tok)
    hf_tok.model_max_length = args.max_position_embeddings
    hf_tok.save_pretrained(out)
    _normalise_tokenizer_files(out)

    samples = [] if args.no_samples else generate_samples(model, hf_tok)
    for prompt, text in samples:
        log(f"sample: {prompt!r} -> {text!r}")

    tokens_seen = args.steps * args.batch_size * args.seq_len
    info = {
        "config": model.config.to_dict(),
        "num_params": num_params,
        "dtype": args.save_dtype,
        "weights_mb": (out / "model.safetensors").stat().st_size / 1e6,
        "dir_mb": 0.0,
        "eos_token_ids": eos_ids,
        "rope_theta": ROPE_THETA,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "machine": f"{platform.machine()} CPU",
        "num_docs": len(docs),
        "num_chars": num_chars,
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "heldout_scored": scored,
        "heldout_percent": args.heldout_percent,
        "chat_fraction": args.chat_fraction,
        "heldout_nll": nll,
        "heldout_ppl": math.exp(nll),
        "unigram_ppl": math.exp(uni),
        "copy_accuracy": copy_acc,
        "copy_fraction": args.copy_fraction,
        "copy_max_copies": args.copy_max_copies,
        "losses": losses,
        "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "samples": samples,
        "betas": betas,
        "weight_decay": args.weight_decay,
        "lr": args.lr,
        "min_lr_ratio": args.min_lr_ratio,
        "warmup_steps": min(args.warmup_steps, max(1, args.steps // 10)),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / max(1, len(train_ids)),
        "autocast": "bfloat16" if args.bf16 else "no",
        "threads": args.threads,
        "seed": args.seed,
        "train_seconds": train_seconds,
        "retrain_command": "\n".join(([base["command"]] if base else []) + [retrain_command(args.argv)]),
        "base": base,
    }
    info["total_seconds"] = time.time() - t_start
    write_model_card(out, info)
    info["dir_mb"] = dir_size_mb(out)
    write_model_card(out, info)  # again, now that the directory size is known
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)  # transformers writes the weights 0600
    log(f"saved to {out} ({info['dir_mb']:.1f} MB); total {info['total_seconds'] / 60:.1f} min")
    return info


def _normalise_tokenizer_files(out: pathlib.Path) -> None:
    """Keep the chat template inside tokenizer_config.json (transformers 5 may write it to
    chat_template.jinja instead) and drop files other tools do not need."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["eos_token"] = IM_END
    cfg["pad_token"] = ENDOFTEXT
    cfg["bos_token"] = None
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["clean_up_tokenization_spaces"] = False
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 4.x expects a dict under extra_special_tokens; the list spelling below
    # is read by both 4.x and 5.x.
    extra = cfg.pop("extra_special_tokens", None) or [IM_START]
    cfg["additional_special_tokens"] = list(extra)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def _normalise_config(out: pathlib.Path) -> None:
    """transformers 5 writes RoPE settings only under rope_parameters; also write the
    top-level rope_theta that transformers 4.x and other loaders read."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", ROPE_THETA)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
