"""The model registry: docs/models.md lists it, and an unsupported architecture's error says
what is closest and, for a known family, what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.model_executor.models import registry

ROOT = Path(__file__).resolve().parents[2]


def test_docs_models_md_is_up_to_date():
    doc = ROOT / "docs" / "models.md"
    assert doc.read_text() == registry.markdown_page(), "run: .venv/bin/python -m pagedllm.model_executor.models.registry > docs/models.md"


@pytest.mark.parametrize(
    ("architecture", "messages"),
    [
        ("LlamaForCausalLm", ["Closest supported: LlamaForCausalLM"]),
        ("Gemma2ForCausalLMX", ["Closest supported: ", "Gemma3ForCausalLM"]),
        ("PhimoeForCausalLM", ["mixture-of-experts", "Closest supported: Phi3ForCausalLM"]),
        ("MambaForCausalLM", ["recurrent (state-space / linear-attention) state"]),
        ("MllamaForConditionalGeneration", ["image-text model", "vision encoder pagedllm does not build"]),
        ("Wav2Vec2Model", ["Supported architectures: ", "docs/models.md"]),
    ],
)
def test_unsupported_architecture_names_the_closest_and_the_gap(architecture, messages):
    with pytest.raises(ValueError, match=f"Model architecture '{architecture}' is not supported yet") as info:
        registry.get_model_class(architecture)
    for message in messages:
        assert message in str(info.value)
    if architecture == "Wav2Vec2Model":
        assert "Closest supported" not in str(info.value)
