"""StructuredOutputsParams: vLLM's fields, one constraint per request, the guided_decoding alias."""

import msgspec
import pytest

from pagedllm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams


def test_exactly_one_constraint_names_the_ones_set():
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(whitespace_pattern=" ")
    assert StructuredOutputsParams(choice=["yes", "no"]).kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("choice", [[], ["a", 1]])
def test_choice_must_be_strings(choice):
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=choice)


def test_guided_decoding_is_an_alias_that_crosses_the_transport():
    constraint = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    params = SamplingParams(guided_decoding=constraint)
    assert params.structured_outputs == constraint and params.guided_decoding is None
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.structured_outputs == constraint
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), guided_decoding=constraint)
