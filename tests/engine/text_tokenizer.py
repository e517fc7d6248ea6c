"""A small byte-level BPE trained offline on text written here (emoji, CJK, an added
non-special token), for the detokenizer and output-processor tests."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be, or not to be, that is the question. All that glitters is not gold.
Paged attention stores the key and value cache in fixed-size blocks, so memory is never
wasted on padding. The scheduler batches requests continuously: when one finishes, another
takes its place at once. Prefix caching lets requests that share a system prompt reuse the
blocks already computed. Hello world! Hello there, general Kenobi. Stop here, then go on.
Numbers like 1234, 56.78 and 9,000,000 appear in text; so do URLs such as example.com/a?b=c.
Emoji: 😀 😃 😄 🎉 👍 🚀 ❤️ 🤖 🧠 🐍 — and flags 🇯🇵 🇫🇷 with joiners 👩‍💻 👨‍👩‍👧.
日本語の文章も少し含めます。東京は日本の首都です。今日は良い天気ですね。
中文文本也包括在内。北京是中国的首都。我们正在测试分词器。
한국어 문장도 있습니다. Ελληνικά κείμενα. Кириллица тоже есть. Ünïcödé àccénts çà et là.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE (like GPT-2's), trained offline on CORPUS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    hf.add_tokens(["<tool>"])  # an added token that is not special
    return hf
