"""OutputProcessor: output kinds, stop strings, logprobs, n > 1, aborts, the collector."""

from __future__ import annotations

import asyncio
import math

import pytest
from transformers import PreTrainedTokenizerFast

from pagedllm.messages.engine_core import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.text_tokenizer import build_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Hello world! 😀 日本語"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def make_request(tokenizer, request_id="r0", prompt="Once upon a time,", params=None, **kw):
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokenizer.encode(prompt),
        sampling_params=params if params is not None else SamplingParams(**kw),
        eos_token_id=tokenizer.eos_token_id,
        arrival_time=1.0,
    )


def run_steps(processor, request_id, ids, finish_last=FinishReason.LENGTH, stop_reason=None):
    """Feed one token per step; return the per-step OutputProcessorOutputs."""
    results = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput(
            request_id,
            [token_id],
            finish_reason=finish_last if last else None,
            stop_reason=stop_reason if last else None,
        )
        results.append(processor.process_outputs([out]))
    return results


def outputs_of(results):
    return [ro for r in results for ro in r.request_outputs]


def test_final_only_emits_one_output(tokenizer):
    ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer)
    request = make_request(tokenizer, output_kind=RequestOutputKind.FINAL_ONLY, max_tokens=len(ids))
    processor.add_request(request, "Once upon a time,")
    (ro,) = outputs_of(run_steps(processor, "r0", ids))
    assert ro.finished and ro.request_id == "r0" and ro.prompt == "Once upon a time,"
    assert ro.prompt_token_ids == request.prompt_token_ids
    (completion,) = ro.outputs
    assert completion.text == TEXT and completion.token_ids == ids
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert not processor.has_unfinished_requests()


def test_cumulative_and_delta(tokenizer):
    ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer)
    for request_id, kind in (("c", RequestOutputKind.CUMULATIVE), ("d", RequestOutputKind.DELTA)):
        processor.add_request(make_request(tokenizer, request_id, output_kind=kind), None)
    assert processor.get_num_unfinished_requests() == 2
    cumulative, deltas = [], []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        result = processor.process_outputs(
            [EngineCoreOutput(rid, [token_id], finish_reason=finish) for rid in ("c", "d")]
        )
        assert result.reqs_to_abort == []
        for ro in result.request_outputs:
            (cumulative if ro.request_id == "c" else deltas).append(ro.outputs[0])
    assert len(cumulative) == len(deltas) == len(ids)
    for i, c in enumerate(cumulative):
        assert c.token_ids == ids[: i + 1]
        assert TEXT.startswith(c.text)
        assert "\ufffd" not in c.text
    assert cumulative[-1].text == TEXT and cumulative[-1].finish_reason == "length"
    assert [d.token_ids for d in deltas] == [[i] for i in ids]
    assert "".join(d.text for d in deltas) == TEXT
    assert [d.finish_reason for d in deltas] == [None] * (len(ids) - 1) + ["length"]
    assert not processor.has_unfinished_requests()


def test_stop_string_finishes_and_aborts(tokenizer):
    ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, stop=["lazy dog"]), None)
    results = run_steps(processor, "r0", ids)
    stopped_at = next(i for i, r in enumerate(results) if r.reqs_to_abort)
    assert results[stopped_at].reqs_to_abort == ["r0"]
    assert all(not r.request_outputs for r in results[stopped_at + 1:])  # ignored afterwards
    final = results[stopped_at].request_outputs[0]
    assert final.finished
    completion = final.outputs[0]
    assert completion.text == "The quick brown fox jumps over the "
    assert completion.finish_reason == "stop" and completion.stop_reason == "lazy dog"
    assert tokenizer.decode(completion.token_ids).endswith("lazy dog")
    assert not processor.has_unfinished_requests()


def test_stop_string_on_the_engine_last_step_needs_no_abort(tokenizer):
    ids = tokenizer.encode("Hello world!")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, stop=["!"]), None)
    results = run_steps(processor, "r0", ids)  # the engine finishes on length at "!"
    assert results[-1].reqs_to_abort == []
    completion = results[-1].request_outputs[0].outputs[0]
    assert completion.text == "Hello world"
    assert completion.finish_reason == "stop" and completion.stop_reason == "!"


def test_delta_stream_never_leaks_a_stop_string_prefix(tokenizer):
    ids = tokenizer.encode(TEXT)
    for stop in ["fox jumps", "brown", "Hello world", "日本", "dog. H", "never-matches"]:
        processor = OutputProcessor(tokenizer)
        processor.add_request(
            make_request(tokenizer, stop=[stop], output_kind=RequestOutputKind.DELTA), None
        )
        deltas = [ro.outputs[0] for ro in outputs_of(run_steps(processor, "r0", ids))]
        final_text = TEXT[: TEXT.index(stop)] if stop in TEXT else TEXT
        emitted = ""
        for delta in deltas:
            emitted += delta.text
            assert final_text.startswith(emitted), (stop, emitted)
        assert emitted == final_text
        assert deltas[-1].finish_reason == ("stop" if stop in TEXT else "length")


def test_eos_and_stop_token_finish(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world") + [eos]
    final = RequestOutputKind.FINAL_ONLY
    processor = OutputProcessor(tokenizer)
    eos_request = make_request(tokenizer, "eos", skip_special_tokens=False, output_kind=final)
    processor.add_request(eos_request, None)
    tok_request = make_request(tokenizer, "tok", stop_token_ids=[ids[-2]], output_kind=final)
    processor.add_request(tok_request, None)
    (ro,) = outputs_of(run_steps(processor, "eos", ids, FinishReason.STOP))
    completion = ro.outputs[0]
    assert completion.text == "Hello world"  # the EOS text is left out, as vLLM
    assert completion.token_ids == ids
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    (ro,) = outputs_of(run_steps(processor, "tok", ids[:-1], FinishReason.STOP, ids[-2]))
    completion = ro.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == ids[-2]
    assert completion.text == tokenizer.decode(ids[:-2])  # the stop token's text too
    assert completion.token_ids == ids[:-1]


def test_sample_logprobs(tokenizer):
    a, b, x, y, z, w, v = tokenizer.encode(" quick brown fox jumps over the lazy")[:7]
    assert len({a, b, x, y, z, w, v}) == 7
    steps = [
        # sampled a (rank 3, not in the top 2), then the top 3 (one column too many)
        LogprobsLists([[a, x, y, z]], [[-2.5, -0.1, -0.3, -0.6]], [3]),
        # sampled b is also the top token
        LogprobsLists([[b, b, w, v]], [[-0.2, -0.2, -1.0, -2.0]], [1]),
    ]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        processor = OutputProcessor(tokenizer)
        processor.add_request(make_request(tokenizer, logprobs=2, output_kind=kind), None)
        completions = []
        for i, (token_id, lists) in enumerate(zip([a, b], steps)):
            finish = FinishReason.LENGTH if i == 1 else None
            out = EngineCoreOutput("r0", [token_id], new_logprobs=lists, finish_reason=finish)
            completions.append(processor.process_outputs([out]).request_outputs[0].outputs[0])
        first = {
            a: Logprob(-2.5, 3, tokenizer.decode([a])),
            x: Logprob(-0.1, 1, tokenizer.decode([x])),
            y: Logprob(-0.3, 2, tokenizer.decode([y])),
        }
        second = {
            b: Logprob(-0.2, 1, tokenizer.decode([b])),
            w: Logprob(-1.0, 2, tokenizer.decode([w])),
        }
        assert completions[0].cumulative_logprob == pytest.approx(-2.5)
        assert completions[1].cumulative_logprob == pytest.approx(-2.7)
        if kind == RequestOutputKind.DELTA:
            assert completions[0].logprobs == [first] and completions[1].logprobs == [second]
        else:
            assert completions[0].logprobs == [first] and completions[1].logprobs == [first, second]


def test_logprobs_zero_gives_only_the_sampled_token(tokenizer):
    processor = OutputProcessor(None)  # no tokenizer: no text, no decoded tokens
    processor.add_request(make_request(tokenizer, logprobs=0, detokenize=False), None)
    lists = LogprobsLists([[7, 3, 4]], [[-1.5, -0.5, -0.9]], [5])
    out = EngineCoreOutput("r0", [7], new_logprobs=lists, finish_reason=FinishReason.LENGTH)
    (completion,) = processor.process_outputs([out]).request_outputs[0].outputs
    assert completion.logprobs == [{7: Logprob(-1.5, 5, None)}]
    assert completion.text == "" and completion.token_ids == [7]


def _prompt_lists(prompt_ids, positions):
    """Prompt logprobs for ``positions`` (1-based: position 0 has none), with top 2."""
    return LogprobsLists(
        [[prompt_ids[p], 11, 12] for p in positions],
        [[-float(p), -0.01, -0.02] for p in positions],
        [p for p in positions],
    )


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_prompt_logprobs_over_chunked_prefill_and_cached_tokens(tokenizer, kind):
    prompt = "Paged attention stores the key and value cache in blocks"
    request = make_request(tokenizer, prompt=prompt, prompt_logprobs=1, output_kind=kind)
    prompt_ids = request.prompt_token_ids
    assert 11 not in prompt_ids and 12 not in prompt_ids
    half = len(prompt_ids) // 2
    processor = OutputProcessor(tokenizer)
    processor.add_request(request, prompt)
    chunk1 = EngineCoreOutput(
        "r0", [], new_prompt_logprobs=_prompt_lists(prompt_ids, range(1, half)), num_cached_tokens=4
    )
    assert processor.process_outputs([chunk1]).request_outputs == []  # nothing generated yet
    chunk2 = EngineCoreOutput(
        "r0", [5], new_prompt_logprobs=_prompt_lists(prompt_ids, range(half, len(prompt_ids)))
    )
    last = EngineCoreOutput("r0", [6], finish_reason=FinishReason.LENGTH)
    outputs = outputs_of([processor.process_outputs([chunk2]), processor.process_outputs([last])])
    prompt_logprobs = outputs[0].prompt_logprobs
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for p in range(1, len(prompt_ids)):
        entry = prompt_logprobs[p]
        assert entry[prompt_ids[p]].rank == p and entry[prompt_ids[p]].logprob == -float(p)
        assert entry[11] == Logprob(-0.01, 1, tokenizer.decode([11]))
        assert 12 not in entry  # only prompt_logprobs=1 top entries
    assert all(ro.num_cached_tokens == 4 for ro in outputs)
    if kind == RequestOutputKind.DELTA:
        assert len(outputs) == 2 and outputs[1].prompt_logprobs is None
    else:
        assert len(outputs) == 1


def _parallel_setup(tokenizer, kind, queue=None):
    parent = ParentRequest("p", SamplingParams(n=2, seed=7, max_tokens=50, output_kind=kind))
    processor = OutputProcessor(tokenizer)
    for i in range(2):
        child_id, params = parent.get_child_info(i)
        request = make_request(tokenizer, child_id, params=params)
        processor.add_request(request, "Once upon a time,", parent, i, queue)
    return parent, processor


def test_parent_request_children():
    parent = ParentRequest("p", SamplingParams(n=3, seed=10))
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_p", "1_p", "2_p"]
    assert [p.seed for _, p in infos] == [10, 11, 12]
    assert all(p.n == 1 for _, p in infos)
    assert parent.sampling_params.n == 3 and parent.sampling_params.seed == 10
    assert ParentRequest("q", SamplingParams(n=2)).get_child_info(1)[1].seed is None
    with pytest.raises(ValueError):
        parent.get_child_info(3)


CHILD_TEXTS = ["Hello world!", "The quick brown fox jumps"]


def _run_parallel(tokenizer, processor):
    """Child 1's outputs come first in each step; child 0 finishes earlier."""
    child_ids = [tokenizer.encode(t) for t in CHILD_TEXTS]
    assert len(child_ids[0]) < len(child_ids[1])
    results = []
    for step in range(len(child_ids[1])):
        outs = []
        for i in (1, 0):
            ids = child_ids[i]
            if step < len(ids):
                finish = FinishReason.LENGTH if step == len(ids) - 1 else None
                outs.append(EngineCoreOutput(f"{i}_p", [ids[step]], finish_reason=finish))
        results.append(processor.process_outputs(outs))
    return child_ids, results


def test_parallel_sampling_final_only(tokenizer):
    parent, processor = _parallel_setup(tokenizer, RequestOutputKind.FINAL_ONLY)
    child_ids, results = _run_parallel(tokenizer, processor)
    (ro,) = outputs_of(results)
    assert ro.request_id == "p" and ro.finished
    assert [c.index for c in ro.outputs] == [0, 1]
    assert [c.text for c in ro.outputs] == CHILD_TEXTS
    assert [c.token_ids for c in ro.outputs] == child_ids
    assert parent.finished and not processor.parent_requests
    assert not processor.has_unfinished_requests()


def test_parallel_sampling_delta_and_cumulative(tokenizer):
    _, processor = _parallel_setup(tokenizer, RequestOutputKind.DELTA)
    child_ids, results = _run_parallel(tokenizer, processor)
    outputs = outputs_of(results)
    assert len(outputs) == len(child_ids[1])  # one joined output per step
    texts, tokens = ["", ""], [[], []]
    for step, ro in enumerate(outputs):
        assert ro.request_id == "p"
        expected = [0, 1] if step < len(child_ids[0]) else [1]
        assert [c.index for c in ro.outputs] == expected
        for c in ro.outputs:
            texts[c.index] += c.text
            tokens[c.index] += c.token_ids
        assert ro.finished == (step == len(outputs) - 1)
    assert texts == CHILD_TEXTS and tokens == child_ids

    _, processor = _parallel_setup(tokenizer, RequestOutputKind.CUMULATIVE)
    _, results = _run_parallel(tokenizer, processor)
    outputs = outputs_of(results)
    assert all([c.index for c in ro.outputs] == [0, 1] for ro in outputs)
    assert [c.text for c in outputs[-1].outputs] == CHILD_TEXTS
    assert [c.finish_reason for c in outputs[-1].outputs] == ["length", "length"]


def test_abort_parent_with_queue(tokenizer):
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    _, processor = _parallel_setup(tokenizer, RequestOutputKind.DELTA, queue)
    ids = tokenizer.encode("Hello world")
    for token_id in ids:
        outs = [EngineCoreOutput(f"{i}_p", [token_id]) for i in range(2)]
        result = processor.process_outputs(outs)
        assert result.request_outputs == []  # they go to the queue
    assert processor.abort_requests(["p", "unknown"]) == ["0_p", "1_p"]
    assert not processor.has_unfinished_requests() and not processor.parent_requests
    ro = queue.get_nowait()  # all steps merged, the consumer never read
    assert ro.finished and ro.request_id == "p"
    assert [c.text for c in ro.outputs] == ["Hello world"] * 2
    assert [c.token_ids for c in ro.outputs] == [ids] * 2
    assert [c.finish_reason for c in ro.outputs] == ["abort"] * 2
    assert queue.get_nowait() is None
    assert processor.process_outputs([EngineCoreOutput("0_p", [1])]).request_outputs == []
    assert processor.abort_requests(["p"]) == []


def test_abort_single_request(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, "a"), None)
    processor.add_request(make_request(tokenizer, "b"), None)
    assert processor.abort_requests(["a"]) == ["a"]
    assert processor.get_num_unfinished_requests() == 1


def test_collector_async_get_and_merge(tokenizer):
    async def main():
        queue = RequestOutputCollector(RequestOutputKind.DELTA)
        processor = OutputProcessor(tokenizer)
        request = make_request(tokenizer, output_kind=RequestOutputKind.DELTA, logprobs=0)
        processor.add_request(request, None, queue=queue)
        ids = tokenizer.encode("Hello there, general Kenobi")

        def step(i):
            lists = LogprobsLists([[ids[i]]], [[-0.5]], [1])
            finish = FinishReason.LENGTH if i == len(ids) - 1 else None
            out = EngineCoreOutput("r0", [ids[i]], lists, finish_reason=finish)
            processor.process_outputs([out])

        waiter = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        step(0)
        first = await waiter
        assert first.outputs[0].token_ids == ids[:1]
        for i in range(1, len(ids)):
            step(i)
        merged = await queue.get()
        assert merged.finished and merged.outputs[0].token_ids == ids[1:]
        assert first.outputs[0].text + merged.outputs[0].text == "Hello there, general Kenobi"
        assert len(merged.outputs[0].logprobs) == len(ids) - 1
        assert merged.outputs[0].cumulative_logprob == pytest.approx(-0.5 * len(ids))
        queue.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await queue.get()

    asyncio.run(main())


def test_log_stats_metrics(tokenizer):
    processor = OutputProcessor(tokenizer, log_stats=True)
    processor.add_request(make_request(tokenizer), None)
    (ro,) = outputs_of(run_steps(processor, "r0", tokenizer.encode("Hi")[:1]))
    metrics = ro.metrics
    assert metrics["arrival_time"] == 1.0 and metrics["num_generation_tokens"] == 1
    assert metrics["first_token_time"] is not None
    assert math.isclose(metrics["first_token_time"], metrics["last_token_time"])
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer), None)
    assert outputs_of(run_steps(processor, "r0", [5]))[0].metrics is None


def test_duplicate_request_id_rejected(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer), None)
    with pytest.raises(ValueError, match="already running"):
        processor.add_request(make_request(tokenizer), None)


def test_stop_string_in_a_multi_token_step_drops_later_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    lists = LogprobsLists([[i] for i in ids], [[-1.0] for _ in ids], [1 for _ in ids])
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(tokenizer, stop=["fox"], logprobs=0), None)
    result = processor.process_outputs([EngineCoreOutput("r0", ids, new_logprobs=lists)])
    assert result.reqs_to_abort == ["r0"]
    (completion,) = result.request_outputs[0].outputs
    assert completion.text == "The quick brown " and completion.stop_reason == "fox"
    assert tokenizer.decode(completion.token_ids).endswith("fox")
    assert len(completion.token_ids) < len(ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    assert completion.cumulative_logprob == -float(len(completion.token_ids))
