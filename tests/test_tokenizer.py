"""``get_tokenizer`` keeps transformers' "Token indices sequence length is longer than the
specified maximum sequence length" warning out of the log (the engine checks lengths itself)."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagedllm.tokenizer import get_tokenizer

WARNING = "Token indices sequence length is longer than the specified maximum sequence length"


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def test_too_long_warning_is_silenced(tiny_llama, caplog):
    text = "hello world " * 200
    plain = AutoTokenizer.from_pretrained(str(tiny_llama))
    plain.model_max_length = 16
    plain.encode(text)
    assert len(warnings_in(caplog)) == 1  # what transformers does by itself

    tokenizer = get_tokenizer(tiny_llama)
    tokenizer.model_max_length = 16
    assert len(tokenizer.encode(text)) > 16
    assert len(warnings_in(caplog)) == 1


def test_trust_remote_code_reaches_the_tokenizer(tiny_llama, monkeypatch):
    """``--trust-remote-code`` (LLM(trust_remote_code=True)) lets transformers load a
    tokenizer class shipped with the checkpoint, as in vLLM."""
    from pagedllm import LLM

    seen = []
    original = AutoTokenizer.from_pretrained

    def recording(path, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(path, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    LLM(str(tiny_llama), trust_remote_code=True, kv_cache_memory_bytes=4 << 20)
    LLM(str(tiny_llama), kv_cache_memory_bytes=4 << 20)
    assert seen == [True, False]
