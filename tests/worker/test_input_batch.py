"""The persistent batch's sampling state: its ``SamplingMetadata`` view equals the one built
from scratch, is reused while the batch is unchanged, and refreshes seeds, min_tokens and
output tokens every step."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.messages.sched_output import NewRequestData
from pagedllm.model_executor.sampling_metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, seed_for_step

VOCAB = 50
EOS = 2


def make_batch() -> InputBatch:
    return InputBatch(max_num_reqs=8, max_model_len=64, block_size=4, device=torch.device("cpu"))


def add(batch, req_id, prompt, params, outputs=()):
    batch.add_request(NewRequestData(
        req_id=req_id, token_ids=list(prompt) + list(outputs), num_prompt_tokens=len(prompt),
        output_token_ids=list(outputs), sampling_params=params, eos_token_id=EOS, block_ids=([],),
        num_computed_tokens=0))
    return batch.requests[req_id]


def view(batch, states, vocab=VOCAB):
    """The metadata of one sampled position per request, after all its known tokens."""
    rows = np.array([s.row for s in states], dtype=np.int64)
    num_outputs = np.array([len(s.output_token_ids) for s in states], dtype=np.int64)
    return batch.sampling_metadata(rows, num_outputs, vocab)


def assert_same_metadata(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for name in ("all_greedy", "all_random", "no_penalties", "output_token_ids", "min_tokens",
                 "logit_bias", "max_num_logprobs", "bad_words_token_ids"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalties",
                 "frequency_penalties", "repetition_penalties", "prompt_token_ids", "disallowed_token_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name


MIXED = [
    SamplingParams(temperature=0.0, _bad_words_token_ids=[[3], [20, 4]]),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, logprobs=3, allowed_token_ids=[1, 2, 5]),
    SamplingParams(top_k=1, min_tokens=4, stop_token_ids=[7], logit_bias={3: 2.0}),
    SamplingParams(temperature=1.3, min_p=0.2, repetition_penalty=1.5, presence_penalty=0.5,
                   frequency_penalty=0.25, min_tokens=1, ignore_eos=True),
]


def test_view_equals_the_metadata_built_from_scratch():
    batch = make_batch()
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    outputs = [[20], [21, 22], [], [23, 23, 24]]
    states = [add(batch, str(i), p, params, o)
              for i, (p, params, o) in enumerate(zip(prompts, MIXED, outputs))]
    # Rows in another order than they were added, as a step's scheduling order may be.
    order = [states[i] for i in (2, 0, 3, 1)]
    got = view(batch, order)
    want = SamplingMetadata.from_params(
        [s.sampling_params for s in order], [prompts[int(s.req_id)] for s in order],
        [outputs[int(s.req_id)] for s in order], VOCAB, eos_token_id=EOS)
    assert_same_metadata(got, want)
    assert got.min_tokens == {0: (4, {7, EOS})}  # row 3 (min_tokens 1) has its token


def test_view_is_reused_until_the_batch_changes_and_follows_the_outputs():
    batch = make_batch()
    a = add(batch, "a", [1, 2], SamplingParams(presence_penalty=1.0, min_tokens=2))
    b = add(batch, "b", [3], SamplingParams(temperature=0.0))
    first = view(batch, [a, b])
    assert first.min_tokens == {0: (2, {EOS})} and first.output_token_ids == [[], []]
    batch.append_token(a, 9)
    batch.append_token(b, 8)
    second = view(batch, [a, b])
    assert second is first  # nothing rebuilt
    assert second.output_token_ids == [[9], [8]] and second.min_tokens == {0: (2, {EOS})}
    batch.append_token(a, 9)
    assert view(batch, [a, b]).min_tokens == {}  # a reached its min_tokens
    assert view(batch, [b]) is not first  # other rows
    c = add(batch, "c", [4], SamplingParams())
    assert view(batch, [a, b]) is not first  # a request was added
    batch.remove_request("c")
    assert c.row not in batch.generators and c.row not in batch.output_token_ids



def test_views_of_several_row_lists_are_kept():
    """Speculative decoding samples a request at 1 + k positions, k changing from step to
    step: each row list keeps its view, refreshed for the step, until the batch changes."""
    batch = make_batch()
    state = add(batch, "s", [1, 2], SamplingParams(frequency_penalty=1.0), outputs=[5])
    views = {k: batch.sampling_metadata(np.full(1 + k, state.row), np.arange(1, 2 + k), VOCAB) for k in range(5)}
    assert len({id(v) for v in views.values()}) == 5
    batch.append_token(state, 6)
    again = batch.sampling_metadata(np.full(3, state.row), np.array([2, 3, 4]), VOCAB)
    assert again is views[2]
    assert again.output_token_ids == [[5, 6], [5, 6, 0], [5, 6, 0, 0]]  # drafts past the outputs: token_ids
    add(batch, "t", [3], SamplingParams())
    assert batch.sampling_metadata(np.full(3, state.row), np.array([2, 3, 4]), VOCAB) is not views[2]

def test_seeded_rows_are_reseeded_for_their_output_position():
    batch = make_batch()
    seeded = add(batch, "s", [1, 2, 3], SamplingParams(seed=42), outputs=[5, 6])
    plain = add(batch, "p", [1], SamplingParams())
    meta = view(batch, [plain, seeded])
    assert list(meta.generators) == [1]
    expected = torch.Generator().manual_seed(seed_for_step(42, 2))
    assert torch.equal(torch.rand(4, generator=meta.generators[1]), torch.rand(4, generator=expected))


def test_several_positions_of_one_request_get_their_own_seeds_and_outputs():
    batch = make_batch()
    state = add(batch, "s", [1, 2], SamplingParams(seed=7, frequency_penalty=1.0, min_tokens=2),
                outputs=[5, 6, 7])
    rows = np.array([state.row] * 3, dtype=np.int64)
    meta = batch.sampling_metadata(rows, np.array([1, 2, 3]), VOCAB)
    assert meta.output_token_ids == [[5], [5, 6], [5, 6, 7]]
    assert meta.min_tokens == {0: (2, {EOS})}
    assert len({id(g) for g in meta.generators.values()}) == 3
    for j, n in enumerate([1, 2, 3]):
        expected = torch.Generator().manual_seed(seed_for_step(7, n))
        assert torch.equal(torch.rand(3, generator=meta.generators[j]), torch.rand(3, generator=expected))
