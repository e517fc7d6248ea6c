"""The scheduler's side of structured outputs, with a fake grammar (plain Python): a request
waits while its grammar compiles and the others run; bitmask rows only for requests that
sample; the grammar advances with each token and ends the request with "stop"."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from pagedllm.core.request import RequestStatus
from pagedllm.messages.engine_core import EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend_types import StructuredOutputGrammar
from pagedllm.structured_output.request import StructuredOutputRequest
from pagedllm.structured_output.spec import GrammarSpec
from tests.core.test_scheduler import fake_run, make_scheduler

WIDTH = 4  # words of 32 tokens
EOS = 0  # the requests' eos_token_id


class CountingGrammar(StructuredOutputGrammar):
    """Allows token 7 only; ends after ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def accept_tokens(self, token_ids):
        self.accepted.extend(token_ids)
        return all(t == 7 for t in token_ids)

    def validate_tokens(self, token_ids):
        return token_ids

    def rollback(self, num_tokens):
        del self.accepted[len(self.accepted) - num_tokens:]

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, 0] = 1 << 7

    def is_terminated(self):
        return len(self.accepted) >= self.length

    def reset(self):
        self.accepted = []


class FakeManager:
    """Hands out requests whose grammar resolves when the test says so."""

    def __init__(self) -> None:
        self.futures: dict[str, Future] = {}
        self.filled: list[int] = []

    def make_request(self, params):
        so_request = StructuredOutputRequest(GrammarSpec("regex", params.regex))
        so_request.future = self.futures[params.regex] = Future()
        return so_request

    def should_fill_bitmask(self, so_request, prompt_token_ids):
        return True  # no reasoning parser

    def should_advance(self, so_request, prompt_token_ids, output_token_ids):
        return True

    def grammar_bitmask(self, grammars, draft_token_ids=None):
        bitmask = np.full((len(grammars), WIDTH), -1, dtype=np.int32)
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        self.filled.append(len(grammars))
        return bitmask


def _scheduler(**kwargs):
    s = make_scheduler(**kwargs)
    s.structured_output_manager = FakeManager()
    return s


def _add(s, req_id, num_prompt, regex=None, max_tokens=8):
    constraint = StructuredOutputsParams(regex=regex) if regex else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint)
    s.add_request(EngineCoreRequest(req_id, list(range(1, num_prompt + 1)), params, 0, 0.0))


def test_request_waits_for_its_grammar_while_others_run():
    s = _scheduler()
    _add(s, "constrained", 5, regex="g1")
    _add(s, "free", 5)
    assert s.requests["constrained"].status == RequestStatus.WAITING_FOR_GRAMMAR
    out = s.schedule()
    assert out.num_scheduled_tokens == {"free": 5}
    assert out.grammar_bitmask is None and out.structured_output_request_ids == {}
    assert [r.request_id for r in s.waiting] == ["constrained"], "it keeps its place"
    fake_run(s, out)
    s.structured_output_manager.futures["g1"].set_result(CountingGrammar(length=3))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"free": 1, "constrained": 5}
    assert out.structured_output_request_ids == {"constrained": 0}, "only the constrained row"
    assert out.grammar_bitmask.shape == (1, WIDTH) and out.grammar_bitmask[0, 0] == 1 << 7


def test_no_bitmask_row_during_prefill_chunks_and_grammar_end_is_stop():
    s = _scheduler(max_num_batched_tokens=4)
    _add(s, "c", 10, regex="g")  # ignore_eos: only the grammar can end it before max_tokens
    grammar = CountingGrammar(length=2)
    s.structured_output_manager.futures["g"].set_result(grammar)
    rows = []
    finish = None
    while s.has_unfinished_requests():
        out = s.schedule()
        rows.append(dict(out.structured_output_request_ids))
        for o in fake_run(s, out, token=EOS).outputs:
            finish = o.finish_reason
    # 10 prompt tokens in chunks of 4, 4, 2 (the last one samples), then one decode.
    assert rows == [{}, {}, {"c": 0}, {"c": 0}]
    assert grammar.accepted == [EOS, EOS]
    assert finish == FinishReason.STOP
    assert s._num_constrained == 0, "an idle scheduler skips structured outputs"


def test_failed_compile_finishes_the_request_aborted():
    s = _scheduler()
    _add(s, "bad", 5, regex="g")
    s.structured_output_manager.futures["g"].set_exception(ValueError("no such rule"))
    out = s.schedule()
    assert out.is_empty
    outputs = fake_run(s, out).outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", FinishReason.ABORT)]
    assert not s.has_unfinished_requests() and s.kv_cache_manager.usage == 0


def test_abort_while_waiting_for_grammar():
    s = _scheduler()
    _add(s, "c", 5, regex="g")
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s._num_constrained == 0
