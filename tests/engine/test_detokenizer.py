"""IncrementalDetokenizer: incremental text == full decode, UTF-8 safety, stop strings."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.messages.engine_core import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from tests.engine.text_tokenizer import CORPUS, build_tokenizer

@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    # NOTE: overrides the shared conftest tokenizer: this one has an added non-special
    # token and merges for emoji/CJK text, trained on text written here.
    return build_tokenizer()


def make_detok(tokenizer, prompt: str = "Once upon a time,", **params) -> IncrementalDetokenizer:
    request = EngineCoreRequest(
        request_id="r0",
        prompt_token_ids=tokenizer.encode(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_id=tokenizer.eos_token_id,
        arrival_time=0.0,
    )
    return IncrementalDetokenizer(tokenizer, request)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], object]:
    """Feed ids in chunks; return the text increments and the matched stop string."""
    pieces: list[str] = []
    for start in range(0, len(ids), chunk):
        before = detok.output_text
        finished = start + chunk >= len(ids)
        stop = detok.update(ids[start:start + chunk], stop_terminated=False, finished=finished)
        assert detok.output_text.startswith(before) or stop is not None
        pieces.append(detok.output_text[len(before):])
        if stop is not None:
            return pieces, stop
    return pieces, None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_full_decode_random_ids(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        for chunk in (1, rng.randint(2, 6)):
            detok = make_detok(tokenizer, skip_special_tokens=skip_special_tokens)
            pieces, _ = feed(detok, ids, chunk)
            assert detok.output_text == expected, (ids, chunk)
            assert "".join(pieces) == expected
            assert detok.output_token_ids == ids


def test_partial_text_is_a_prefix_and_never_adds_replacement_chars(tokenizer):
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(20)]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        detok = make_detok(tokenizer)
        for i, token_id in enumerate(ids):
            detok.update([token_id], stop_terminated=False, finished=i == len(ids) - 1)
            assert full.startswith(detok.output_text)
            assert detok.output_text.count("\ufffd") <= full.count("\ufffd")


@pytest.mark.parametrize(
    "text",
    ["Emoji: 😀 🎉 👩‍💻 🇯🇵 done", "東京は日本の首都です。", "中文文本 한국어 Ünïcödé ❤️🤖"],
)
def test_multibyte_characters_never_emit_a_partial_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # characters really are split across tokens
    detok = make_detok(tokenizer)
    pieces = []
    for token_id in ids:
        before = detok.output_text
        detok.update([token_id], stop_terminated=False)
        pieces.append(detok.output_text[len(before):])
        assert "\ufffd" not in detok.output_text
    assert "".join(pieces) == text
    # some token really ended inside a character (its bytes had to be held back)
    assert any(tokenizer.decode(ids[: i + 1]).endswith("\ufffd") for i in range(len(ids)))


def test_prompt_context_and_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(" Hello") + [eos] + tokenizer.encode("<tool> world")
    for skip in (True, False):
        detok = make_detok(tokenizer, skip_special_tokens=skip)
        feed(detok, ids)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<tool>" in detok.output_text and "<|endoftext|>" in detok.output_text


class _SlowTokenizer:
    """A minimal slow (non-fast) tokenizer: tokens are joined without a decoder."""

    is_fast = False
    vocab = ["<s>", "<x>", "a", "b", "c"]
    all_special_ids = [0]
    all_special_tokens = ["<s>"]

    def __len__(self) -> int:
        return len(self.vocab)

    def get_added_vocab(self) -> dict[str, int]:
        return {"<s>": 0, "<x>": 1}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.vocab[token_id]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


@pytest.mark.parametrize(
    "skip,spaces,expected",
    [
        (False, True, "ab <s> c <x> a"),
        (False, False, "ab<s>c<x>a"),
        (True, True, "abc <x> a"),
        (True, False, "abc<x>a"),
    ],
)
def test_slow_tokenizer_spaces_between_special_tokens(skip, spaces, expected):
    request = EngineCoreRequest(
        request_id="r0",
        prompt_token_ids=[2],
        sampling_params=SamplingParams(
            skip_special_tokens=skip, spaces_between_special_tokens=spaces
        ),
        eos_token_id=0,
        arrival_time=0.0,
    )
    detok = IncrementalDetokenizer(_SlowTokenizer(), request)
    for token_id in [2, 3, 0, 4, 1, 2]:
        detok.update([token_id], stop_terminated=False)
    assert detok.output_text == expected


def _stop_case(tokenizer, text: str, stop: str, **params):
    ids = tokenizer.encode(text)
    detok = make_detok(tokenizer, stop=[stop], **params)
    pieces, matched = feed(detok, ids)
    return ids, detok, pieces, matched


def test_stop_string_across_tokens(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "brown fox jumps"
    ids, detok, pieces, matched = _stop_case(tokenizer, text, stop)
    assert matched == stop and detok.stop_string == stop
    assert detok.output_text == "The quick "
    # It matched on the token that completed the stop string; later tokens are dropped.
    end = text.index(stop) + len(stop)
    n = next(i for i in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:i])) >= end)
    assert detok.output_token_ids == ids[:n]
    assert n >= 3 and len(pieces) == n


def test_stop_string_in_the_middle_of_a_token(tokenizer):
    text = "Hello world! Paged attention stores the key and value cache."
    ids = tokenizer.encode(text)
    tokens = [tokenizer.decode([i]) for i in ids]
    # A stop string strictly inside one multi-character token.
    k = next(i for i, t in enumerate(tokens) if len(t.strip()) >= 5 and i > 2)
    stop = tokens[k].strip()[1:-1]
    assert stop not in "".join(tokens[:k]) + tokens[k][:1]
    start = len("".join(tokens[:k])) + tokens[k].index(stop)
    for include in (False, True):
        detok = make_detok(tokenizer, stop=[stop], include_stop_str_in_output=include)
        _, matched = feed(detok, ids)
        assert matched == stop
        assert detok.output_text == text[: start + (len(stop) if include else 0)]
        assert detok.output_token_ids == ids[: k + 1]


def test_stop_string_inside_one_multi_token_update(tokenizer):
    text = "To be, or not to be, that is the question."
    ids = tokenizer.encode(text)
    detok = make_detok(tokenizer, stop=["not"])
    assert detok.update(ids, stop_terminated=False) == "not"
    assert detok.output_text == "To be, or "
    assert len(detok.output_token_ids) < len(ids)
    assert tokenizer.decode(detok.output_token_ids).endswith("not")


def test_earliest_stop_string_wins(tokenizer):
    text = "All that glitters is not gold."
    detok = make_detok(tokenizer, stop=["gold", "that", "glitters"])
    assert detok.update(tokenizer.encode(text), stop_terminated=False) == "that"
    assert detok.output_text == "All "


def test_include_stop_str_in_output(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    _, detok, _, matched = _stop_case(tokenizer, text, "fox", include_stop_str_in_output=True)
    assert matched == "fox"
    assert detok.output_text == "The quick brown fox"
    assert detok.stop_buffer_length == 0


def test_min_tokens_delays_stop_string_checks(tokenizer):
    text = "Stop here, then go on. Stop here again."
    ids = tokenizer.encode(text)
    first_stop_tokens = next(
        i for i in range(1, len(ids)) if "Stop here" in tokenizer.decode(ids[:i])
    )
    _, detok, _, matched = _stop_case(tokenizer, text, "Stop", min_tokens=first_stop_tokens)
    assert matched == "Stop"
    assert detok.output_text == "Stop here, then go on. "
    _, detok, _, _ = _stop_case(tokenizer, text, "Stop")
    assert detok.output_text == ""


def test_stop_terminated_token_text_left_out_unless_included(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world") + [eos]
    for include, expected in ((False, "Hello world"), (True, "Hello world<|endoftext|>")):
        detok = make_detok(tokenizer, skip_special_tokens=False, include_stop_str_in_output=include)
        detok.update(ids[:-2], stop_terminated=False)
        assert detok.update(ids[-2:], stop_terminated=True, finished=True) is None
        assert detok.output_text == expected
        assert detok.output_token_ids == ids


def test_streamed_deltas_hold_back_stop_string_fragments(tokenizer):
    rng = random.Random(2)
    sentences = [s.strip() for s in CORPUS.replace("\n", " ").split(".") if len(s.strip()) > 20]
    for sentence in sentences:
        ids = tokenizer.encode(sentence)
        # A stop string from the middle of the sentence (sometimes one that never matches).
        a = rng.randrange(1, len(sentence) - 5)
        stop = sentence[a:a + rng.randint(2, 6)] + ("" if rng.random() < 0.8 else "\x00")
        detok = make_detok(tokenizer, stop=[stop, "zzzzzzzzzz"[: rng.randint(1, 3)]])
        emitted = ""
        for i, token_id in enumerate(ids):
            matched = detok.update([token_id], stop_terminated=False)
            finished = matched is not None or i == len(ids) - 1
            emitted += detok.get_next_output_text(finished=finished, delta=True)
            if not finished:  # nothing emitted may be cut later
                assert emitted == detok.get_next_output_text(finished=False, delta=False)
                assert sentence.startswith(emitted)
                if stop in sentence:
                    assert len(emitted) <= sentence.index(stop)
            if finished:
                break
        assert emitted == detok.output_text
        assert detok.get_next_output_text(finished=True, delta=True) == ""
        expected = sentence[: sentence.index(stop)] if stop in sentence else sentence
        assert detok.output_text == expected, (sentence, stop)


def test_no_text_without_detokenize(tokenizer):
    detok = make_detok(tokenizer, detokenize=False)
    detok.update([5, 6, 7], stop_terminated=False, finished=True)
    assert detok.output_text == "" and detok.output_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="stop strings"):
        make_detok(tokenizer, detokenize=False, stop=["x"])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_level_fast_path_equals_window_decoder(tokenizer, skip_special_tokens):
    """Byte-level BPE tokenizers take the byte-append decoder; it emits the same text as
    the window decoder (every other tokenizer's path), piece by piece up to holding back
    less, and the same text in total, on random ids (lone continuation bytes, cut
    characters, special and added tokens) and on out-of-range ids."""
    from pagedllm.engine import detokenizer as detok_mod

    detok = make_detok(tokenizer, skip_special_tokens=skip_special_tokens)
    assert isinstance(detok._decoder, detok_mod._ByteLevelDecoder)
    rng = random.Random(7)
    prompt_ids = tokenizer.encode("Once upon a time,")
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer) + 2) for _ in range(rng.randint(1, 30))]  # +2: out of range
        fast = detok_mod._ByteLevelDecoder(detok_mod._tokenizer_info(tokenizer), skip_special_tokens)
        window = detok_mod._WindowDecoder(tokenizer, prompt_ids, skip_special_tokens, True)
        fast_text = "".join(fast.decode_next(i) for i in ids) + fast.flush()
        window_text = "".join(window.decode_next(i) for i in ids) + window.flush()
        assert fast_text == window_text, ids
        in_range = [i for i in ids if i < len(tokenizer)]
        assert fast_text == tokenizer.decode(in_range, skip_special_tokens=skip_special_tokens)


def test_slow_or_non_byte_level_tokenizers_keep_the_window_decoder(tokenizer):
    from pagedllm.engine import detokenizer as detok_mod

    class NotByteLevel:
        is_fast = True
        backend_tokenizer = None  # no ``decoder``: not a byte-level tokenizer

    assert detok_mod._byte_level_table(NotByteLevel()) is None
