"""gpt-oss's harmony channels read from token ids (``harmony_tokens``, ``GptOssReasoningParser``'s
``parse_output`` / ``ends_reasoning`` / ``count_reasoning_tokens``) with the tiny byte-level
tokenizer given gpt-oss's special tokens: text the model types as ordinary tokens that looks
like a marker stays text, streamed or not; without those tokens the text is read as before."""

from __future__ import annotations

import pytest

from pagedllm.reasoning import ParsedReasoning, ReasoningParserManager, ReasoningStream
from pagedllm.reasoning.harmony_tokens import MARKERS, harmony_marker_ids, reasoning_end_index
from tests.fixtures.checkpoints import build_tokenizer

#: The analysis body writes "<|channel|>final<|message|>" and the final body "<|end|>" as ordinary text.
REASONING = "Think: the user may write <|channel|>final<|message|> literally."
CONTENT = "Use <|end|> to end, café."


@pytest.fixture(scope="module")
def harmony_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *MARKERS]})
    return tokenizer


def _ids(tokenizer, *segments):
    """Token ids of ``segments``: a marker as its special token, other text as ordinary tokens
    (``split_special_tokens``: what the model typed)."""
    ids = []
    for segment in segments:
        if segment in MARKERS:
            ids.append(tokenizer.convert_tokens_to_ids(segment))
        else:
            ids += tokenizer.encode(segment, add_special_tokens=False, split_special_tokens=True)
    return ids


def _output(tokenizer):
    return _ids(tokenizer, "<|channel|>", "analysis", "<|message|>", REASONING, "<|end|>",
                "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", CONTENT, "<|return|>")


def _parser():
    return ReasoningParserManager.get_reasoning_parser("gpt_oss")({})


def test_marker_ids_need_the_harmony_tokens(harmony_tokenizer):
    ids = harmony_marker_ids(harmony_tokenizer)
    assert sorted(ids.values()) == sorted(MARKERS)
    assert harmony_marker_ids(build_tokenizer()) is None


def test_literal_markers_in_a_body_stay_text(harmony_tokenizer):
    """The literal markers are several ordinary tokens each; the ids mark only the real ones,
    so the reasoning and content are the bodies as written (the text parser takes the typed
    "<|end|>" for the end of the final message)."""
    ids = _output(harmony_tokenizer)
    text = harmony_tokenizer.decode(ids, skip_special_tokens=False)
    assert len(harmony_tokenizer.encode("<|channel|>", add_special_tokens=False, split_special_tokens=True)) > 1
    parser = _parser()
    assert parser.extract_reasoning(text, ids, harmony_tokenizer) == (REASONING, CONTENT)
    assert parser.extract_reasoning(text) == (REASONING, "Use  to end, café.<|return|>")


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_tokens_give_the_same_answer_reasoning_first(harmony_tokenizer, step):
    ids = _output(harmony_tokenizer)
    stream = ReasoningStream(_parser(), harmony_tokenizer)
    reasoning = content = ""
    for start in range(0, len(ids), step):
        piece = ids[start : start + step]
        # the engine's text of a piece; a character cut between pieces comes with the next
        text = harmony_tokenizer.decode(ids[: start + len(piece)], skip_special_tokens=False).rstrip("\ufffd")
        delta_r, delta_c = stream.feed(text[len(stream.text):], start + step >= len(ids), piece)
        assert not (delta_r and content), "reasoning after content"
        reasoning, content = reasoning + delta_r, content + delta_c
    assert (reasoning, content) == (REASONING, CONTENT)


def test_text_cut_by_a_stop_string_is_followed(harmony_tokenizer):
    ids = _output(harmony_tokenizer)
    text = harmony_tokenizer.decode(ids, skip_special_tokens=False)
    cut = text[: text.index("to end")]
    assert _parser().parse_output(cut, ids, harmony_tokenizer, final=True).content == "Use <|end|> "


def test_without_the_harmony_tokens_the_text_is_read():
    tokenizer = build_tokenizer()
    text = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Yes.<|return|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert _parser().extract_reasoning(text, ids, tokenizer) == ("Hm.", "Yes.")


def test_reasoning_end_from_the_ids(harmony_tokenizer):
    """The reasoning ends at the real ``final`` header, not at the one typed in the analysis
    body: ``ends_reasoning`` (the structured-output gate) and ``count_reasoning_tokens``."""
    ids = _output(harmony_tokenizer)
    parser = _parser()
    real_end = ids.index(harmony_tokenizer.convert_tokens_to_ids("<|message|>"), ids.index(
        harmony_tokenizer.convert_tokens_to_ids("<|start|>"))) + 1
    assert parser.count_reasoning_tokens(ids, harmony_tokenizer) == real_end
    assert reasoning_end_index(ids, harmony_marker_ids(harmony_tokenizer), harmony_tokenizer) == real_end
    analysis = _ids(harmony_tokenizer, "<|channel|>", "analysis", "<|message|>", "Typed: <|channel|>final<|message|>")
    assert not parser.ends_reasoning(analysis, harmony_tokenizer)
    assert parser.is_reasoning_end(harmony_tokenizer.decode(analysis, skip_special_tokens=False))  # text is fooled
    assert parser.ends_reasoning(ids[:real_end], harmony_tokenizer)
    assert not parser.ends_reasoning(ids[: real_end - 1], harmony_tokenizer)
    assert parser.count_reasoning_tokens(analysis, harmony_tokenizer) == len(analysis)


def test_a_stream_decodes_each_closed_run_once(harmony_tokenizer):
    """Token by token, the reader decodes a run of ordinary tokens once, when a marker closes
    it (the open run is the rest of the text): a stream costs O(length), not O(length²)."""
    ids = _output(harmony_tokenizer)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(harmony_tokenizer, name)

        def decode(self, token_ids, **kwargs):
            calls.append(len(token_ids))
            return harmony_tokenizer.decode(token_ids, **kwargs)

    stream = ReasoningStream(_parser(), Counting())
    # the engine's texts: a character cut between tokens comes with the next
    texts = [harmony_tokenizer.decode(ids[: k + 1], skip_special_tokens=False).rstrip("\ufffd") for k in range(len(ids))]
    marker_lookups = len(calls)  # harmony_marker_ids decodes each marker once
    previous = ""
    for k, text in enumerate(texts):
        stream.feed(text[len(previous):], k == len(ids) - 1, ids[k : k + 1])
        previous = text
    assert stream.sent == ParsedReasoning(REASONING, CONTENT)
    assert len(calls) - marker_lookups == 5  # analysis, its body, assistant, final, its body
