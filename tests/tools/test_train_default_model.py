"""tools/train_default_model.py trains a miniature model for a few steps, the loss falls,
the output is a Hugging Face checkpoint that transformers loads, and a rerun reproduces it."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import load_training_script

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "train_default_model.py"

MINI_ARGS = [
    "--steps", "40",
    "--hidden-size", "64",
    "--num-layers", "2",
    "--num-heads", "4",
    "--num-kv-heads", "2",
    "--vocab-size", "512",
    "--max-chars", "150000",
    "--seq-len", "64",
    "--batch-size", "8",
    "--log-every", "5",
    "--eval-every", "20",
    "--eval-windows", "4",
]

EXPECTED_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
]


def _train(out: pathlib.Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *MINI_ARGS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini") / "model"
    return out, _train(out)


def test_loss_falls(mini):
    _, log = mini
    losses = [float(x) for x in re.findall(r"step\s+\d+/\d+\s+loss ([0-9.]+)", log)]
    assert len(losses) >= 5, log
    first, last = losses[0], sum(losses[-3:]) / 3
    assert first > 5.5, losses  # about ln(512) at initialisation
    assert last < first - 0.5, losses
    assert re.search(r"held-out: loss [0-9.]+ ppl [0-9.]+; unigram ppl [0-9.]+", log), log


def test_output_is_a_hugging_face_checkpoint(mini):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = mini
    for name in EXPECTED_FILES:
        assert (out / name).is_file(), name
    assert not (out / "chat_template.jinja").exists()

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 10000.0

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tok) == 512
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"

    text = "Return the number of items."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips, no BOS added
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)
    assert torch.isfinite(logits).all()

    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]


def test_chat_template_is_chatml(mini):
    from transformers import AutoTokenizer

    out, _ = mini
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_model_card_is_written(mini):
    out, _ = mini
    card = (out / "README.md").read_text()
    assert re.search(r"held-out perplexity: [0-9.]+; unigram perplexity: [0-9.]+", card)
    assert "PSF" in card and "tools/train_default_model.py" in card and "--steps 40" in card


def test_rerun_reproduces_the_checkpoint(mini, tmp_path):
    out, _ = mini
    again = tmp_path / "again"
    _train(again)
    assert _sha256(again / "tokenizer.json") == _sha256(out / "tokenizer.json")
    assert _sha256(again / "model.safetensors") == _sha256(out / "model.safetensors")


@pytest.mark.parametrize("max_copies", [2, 3])
def test_copy_exercises_repeat_a_passage_and_mask_only_noise(max_copies):
    """Every row becomes natural text, S, the blank line, S (up to ``max_copies`` copies),
    natural text; a random S's first occurrence (and the blank line) carries no loss,
    everything else does."""
    import torch

    script = load_training_script()
    sep = (7, 7)
    exercises = script.CopyExercises(fraction=1.0, sep=sep, first_token=3, vocab_size=500, max_copies=max_copies)
    data = torch.arange(1000, 3000)  # "training text": ids >= 1000, never random ones
    gen = torch.Generator().manual_seed(0)
    seen_random = seen_text = 0
    for _ in range(20):
        batch = data[:8 * 65].view(8, 65).clone()
        labels = batch[:, 1:].clone()
        exercises.apply(batch, labels, data, gen)
        for row, lab in zip(batch.tolist(), labels.tolist()):
            at = next(i for i in range(len(row) - 1) if row[i : i + 2] == list(sep))
            # the passage is the run before the blank line that repeats right after it
            length = max(n for n in range(16, at + 1) if row[at - n : at] == row[at + 2 : at + 2 + n])
            start = at - length
            assert 16 <= length <= (65 - 2) // 2
            copies = 1 + sum(row[at + i * (length + 2) : at + i * (length + 2) + 2 + length] == list(sep) + row[start:at]
                             for i in range(max_copies))
            assert 2 <= copies <= max_copies
            masked = [i for i, v in enumerate(lab) if v == -100]
            if row[start] < 1000:  # random passage: ids in [3, 500)
                assert all(3 <= t < 500 for t in row[start:at])
                assert masked == list(range(max(0, start - 1), at + 1))
                seen_random += 1
            else:
                assert masked == []
                seen_text += 1
            assert [v for v in lab if v != -100] == [t for i, t in enumerate(row[1:]) if i not in masked]
    assert seen_random > 20 and seen_text > 20


def test_copy_exercises_fraction_zero_changes_nothing():
    import torch

    script = load_training_script()
    exercises = script.CopyExercises(fraction=0.0, sep=(7,), first_token=3, vocab_size=500)
    batch = torch.arange(4 * 33).view(4, 33)
    labels = batch[:, 1:].clone()
    exercises.apply(batch, labels, torch.arange(1000), torch.Generator().manual_seed(0))
    assert torch.equal(batch, torch.arange(4 * 33).view(4, 33))
    assert torch.equal(labels, batch[:, 1:])
