"""The model that ships inside the package (pagedllm-default): it is where model_paths says,
it loads with transformers, its model card's perplexity claims hold, and greedy generation
reads like English."""

from __future__ import annotations

import json
import math
import pathlib
import platform
import re

import pytest

from pagedllm.model_paths import DEFAULT_MODEL_NAME, default_model_path
from tests.helpers import load_training_script

MODEL_DIR = default_model_path()

HF_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
]


def _card() -> str:
    return (MODEL_DIR / "README.md").read_text(encoding="utf-8")


def _claimed_perplexities() -> tuple[float, float]:
    m = re.search(r"held-out perplexity: ([0-9.]+); unigram perplexity: ([0-9.]+)", _card())
    assert m, "model card must state both perplexities"
    return float(m.group(1)), float(m.group(2))


def _english_score(text: str) -> float:
    """Share of characters that are ASCII letters, whitespace or ordinary punctuation."""
    ok = sum(ch.isascii() and (ch.isalpha() or ch.isspace() or ch in ".,;:'\"()-") for ch in text)
    return ok / max(1, len(text))


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    model.eval()
    return tok, model


def _greedy(tok, model, text: str, max_new_tokens: int = 40) -> str:
    import torch

    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_default_model_path_is_inside_the_package():
    import pagedllm

    assert DEFAULT_MODEL_NAME == "pagedllm-default"
    assert MODEL_DIR.name == DEFAULT_MODEL_NAME
    assert MODEL_DIR.parent == pathlib.Path(pagedllm.__file__).resolve().parent / "assets"
    for name in HF_FILES:
        assert (MODEL_DIR / name).is_file(), name


def test_package_data_fits_the_size_budget():
    assets = MODEL_DIR.parent
    total = sum(p.stat().st_size for p in assets.rglob("*") if p.is_file())
    assert total <= 30 * 1024 * 1024, total


def test_loads_with_transformers(hf):
    tok, model = hf
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert model.config.vocab_size == len(tok)
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= num_params <= 20_000_000
    assert f"{num_params:,}" in _card()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_model_card_states_data_licence_and_retrain_command():
    card = _card()
    assert "PSF" in card and "Python Software Foundation" in card
    assert "tools/train_default_model.py" in card
    held_out, unigram = _claimed_perplexities()
    assert held_out < unigram / 3, (held_out, unigram)


def test_held_out_perplexity_claim_is_reproduced(hf):
    """Recompute the held-out perplexity from the same held-out split (rebuilt by the
    training script from this interpreter's standard library) and compare with the card."""
    tok, model = hf
    train = load_training_script()
    claimed, unigram = _claimed_perplexities()
    m = re.search(r"Python (\d+\.\d+\.\d+)", _card())
    same_python = bool(m) and m.group(1) == platform.python_version()

    from tokenizers import Tokenizer

    raw_tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    docs = train.collect_documents()
    texts = train.format_documents(docs, chat_fraction=0.3, seed=0)
    heldout = [t for d, t in zip(docs, texts) if train.is_heldout(d.unit, 5.0)]
    heldout_ids = train.encode_stream(raw_tok, heldout)
    window = re.search(r"Non-overlapping windows of (\d+) tokens", _card())
    assert window, "the model card must say how the held-out stream was cut"
    windows = train.heldout_windows(heldout_ids, int(window.group(1)) - 1)
    nll, _ = train.evaluate(model, windows)
    ppl = math.exp(nll)
    if same_python:  # same data: the number in the card, up to float summation order
        assert ppl == pytest.approx(claimed, rel=0.01)
    else:  # another CPython's docstrings differ a little
        assert ppl == pytest.approx(claimed, rel=0.3)
    assert ppl < unigram / 3


def test_copy_accuracy_claim_is_reproduced(hf):
    """The shipped model continues a passage it has read (what n-gram speculation needs): the
    card's copy accuracy on held-out passages is reproduced, and it is high."""
    tok, model = hf
    train = load_training_script()
    m = re.search(r"the model's top-1\nprediction is the passage's next token for \*\*([0-9.]+)%\*\*", _card())
    assert m, "the model card must state the copy accuracy"
    claimed = float(m.group(1)) / 100

    from tokenizers import Tokenizer

    raw_tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    docs = train.collect_documents()
    texts = train.format_documents(docs, chat_fraction=0.3, seed=0)
    heldout = [t for d, t in zip(docs, texts) if train.is_heldout(d.unit, 5.0)]
    sep = raw_tok.encode("\n\n", add_special_tokens=False).ids
    accuracy = train.copy_accuracy(model, train.encode_stream(raw_tok, heldout), sep)
    assert accuracy == pytest.approx(claimed, abs=0.02 if platform.python_version() in _card() else 0.1)
    assert accuracy > 0.75


def test_write_heldout_text_keeps_only_held_out_documents(tmp_path, monkeypatch):
    """``--write-heldout-text`` (the text of ``pagedllm bench perplexity`` in docs/benchmarks.md)
    writes the held-out documents' plain text and no training document."""
    train = load_training_script()
    units = [f"module:m{i}" for i in range(200)]
    docs = [train.Document(unit, unit, "docstring", f"Text of {unit}.") for unit in units]
    monkeypatch.setattr(train, "collect_documents", lambda: docs)
    out = tmp_path / "heldout.txt"
    assert train.main(["--write-heldout-text", str(out)]) == {}
    held = [u for u in units if train.is_heldout(u, 5.0)]
    assert held and len(held) < len(units)
    assert out.read_text() == "\n\n".join(f"Text of {u}." for u in held) + "\n"


@pytest.mark.parametrize("prompt", ["Return the number of", "This module provides", "The default value is"])
def test_greedy_generation_reads_like_english(hf, prompt):
    tok, model = hf
    text = _greedy(tok, model, prompt)  # stops early at <|endoftext|> / <|im_end|>
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(words) >= 2, text
    assert _english_score(text) >= 0.85, text
    card = _card()
    assert f"prompt: `{prompt}`" in card
    # The card's samples are this checkpoint's greedy output (fp32, so stable).
    assert text.strip().splitlines()[0] in card, text


def test_chat_answer_reads_like_english(hf):
    tok, model = hf
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What does os.path.join do?"}], tokenize=False, add_generation_prompt=True
    )
    text = _greedy(tok, model, prompt, max_new_tokens=60)
    assert len(re.findall(r"[A-Za-z]{3,}", text)) >= 3, text
    assert _english_score(text) >= 0.85, text
    assert "<|im_start|>" not in text


def test_pagedllm_greedy_equals_transformers_on_the_shipped_model():
    """Both stop at the EOS ids of generation_config.json ([<|im_end|>, <|endoftext|>])."""
    import torch

    from pagedllm import LLM, SamplingParams
    from tests.helpers import hf_model

    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20)
    prompts = ["The default value is", "This module provides", "Return the number of", "A", "Once upon a time"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        expected = hf_model(default_model_path()).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
        )[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected
    assert any(o.outputs[0].finish_reason == "stop" for o in outputs)
