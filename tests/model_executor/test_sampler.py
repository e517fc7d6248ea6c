"""Tests of the batched sampler: exact values for the logit transforms, statistics for
the random draws."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedllm.model_executor.layers.logits_processors import (
    LogitsProcessor,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_token_bitmask,
)
from pagedllm.model_executor.layers.sampler import Argmax, Sampler, compute_logprobs_with_topk
from pagedllm.model_executor.sampling_metadata import SamplingMetadata
from pagedllm.platforms import current_platform
from pagedllm.sampling_params import SamplingParams

#: chi-square critical values at alpha = 0.001 (df -> value), from standard tables.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}


def metadata_for(params, vocab_size, prompts=None, outputs=None, generators=None,
                 eos_token_id=None):
    rows = len(params)
    return SamplingMetadata.from_params(
        params,
        prompt_token_ids=prompts if prompts is not None else [[0]] * rows,
        output_token_ids=outputs if outputs is not None else [[]] * rows,
        vocab_size=vocab_size,
        generators=generators,
        eos_token_id=eos_token_id,
    )


def sample(logits, params, **kwargs):
    return Sampler()(logits, metadata_for(params, logits.shape[-1], **kwargs))


def chi_square(counts: Counter, expected_probs: list[float], draws: int) -> float:
    return sum((counts.get(i, 0) - draws * p) ** 2 / (draws * p)
               for i, p in enumerate(expected_probs))


# --- greedy ------------------------------------------------------------------------


def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.ranks is None


def test_greedy_rows_of_a_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_p=0.5)]
    for _ in range(10):
        out = sample(logits, params).sampled_token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_1_equals_greedy_at_temperature_1():
    torch.manual_seed(2)
    rows, vocab = 8, 64
    # Built by hand so that the rows really take the random path (from_params would
    # mark them greedy, as SamplingParams.is_greedy does).
    meta = metadata_for([SamplingParams()] * rows, vocab)
    meta.top_k = torch.ones(rows, dtype=torch.int64)
    assert meta.all_random
    for _ in range(20):
        logits = torch.randn(rows, vocab)
        out = Sampler()(logits, meta).sampled_token_ids
        assert out.tolist() == logits.argmax(-1).tolist()


def test_input_logits_are_not_modified():
    torch.manual_seed(3)
    logits = torch.randn(2, 10)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.7, top_p=0.5, presence_penalty=1.0,
                                   logit_bias={1: 5.0})] * 2,
           outputs=[[1, 2], [3]])
    assert torch.equal(logits, before)


# --- random sampling: seeds and distributions --------------------------------------------


def _seeded_sequence(row_logits, batch_params, target_row, other_logits, global_seed):
    """Tokens of ``target_row`` over len(row_logits) steps of the given batch mix."""
    torch.manual_seed(global_seed)
    vocab = row_logits[0].shape[-1]
    generators = {}
    for row, p in enumerate(batch_params):
        if p.seed is not None:
            generators[row] = torch.Generator().manual_seed(p.seed)
    tokens = []
    for step, logits in enumerate(row_logits):
        batch = other_logits[step].clone()
        batch[target_row] = logits
        meta = metadata_for(batch_params, vocab, generators=generators)
        tokens.append(int(Sampler()(batch, meta).sampled_token_ids[target_row]))
    return tokens


def test_seeded_row_does_not_depend_on_the_batch():
    steps, vocab = 20, 100
    torch.manual_seed(4)
    row_logits = [0.1 * torch.randn(vocab) for _ in range(steps)]  # near uniform
    others = [torch.randn(4, vocab) for _ in range(steps)]
    target = SamplingParams(temperature=0.9, seed=1234)

    alone = _seeded_sequence(row_logits, [target], 0, [o[:1] for o in others], 10)
    mix_a = _seeded_sequence(
        row_logits, [SamplingParams(), SamplingParams(temperature=0.5), target],
        2, [o[:3] for o in others], 11)
    mix_b = _seeded_sequence(
        row_logits, [SamplingParams(temperature=0.0), target, SamplingParams(seed=7),
                     SamplingParams(top_k=5, top_p=0.9, min_p=0.1)],
        1, others, 12)

    assert len(set(alone)) > 5  # really random, so agreement below means something
    assert alone == mix_a == mix_b


def test_unseeded_rows_differ_between_runs():
    vocab = 100
    logits = torch.zeros(1, vocab)
    draws = [int(sample(logits, [SamplingParams()]).sampled_token_ids) for _ in range(20)]
    assert len(set(draws)) > 5


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_passes_chi_square(temperature):
    torch.manual_seed(5)
    probs = [0.1, 0.2, 0.3, 0.25, 0.15]
    draws = 5000
    logits = torch.tensor(probs).log().expand(draws, -1).contiguous()
    out = sample(logits, [SamplingParams(temperature=temperature)] * draws)
    counts = Counter(out.sampled_token_ids.tolist())

    expected = torch.softmax(torch.tensor(probs).log() / temperature, -1).tolist()
    assert chi_square(counts, expected, draws) < CHI2_CRITICAL_0_001[4]
    # The test has power: the same counts are far from a uniform distribution.
    assert chi_square(counts, [0.2] * 5, draws) > 10 * CHI2_CRITICAL_0_001[4]


def test_seeded_rows_follow_the_distribution():
    probs = [0.5, 0.3, 0.2]
    draws = 3000
    logits = torch.tensor(probs).log().expand(draws, -1).contiguous()
    generators = {row: torch.Generator().manual_seed(row) for row in range(draws)}
    params = [SamplingParams(seed=row) for row in range(draws)]
    out = sample(logits, params, generators=generators)
    counts = Counter(out.sampled_token_ids.tolist())
    assert chi_square(counts, probs, draws) < CHI2_CRITICAL_0_001[2]


# --- truncation: top-k, top-p, min-p ---------------------------------------------------------

#: Sorted most likely first, with no threshold below falling exactly on a boundary.
TRUNCATION_PROBS = [0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.55), {0, 1}),           # mass before token 2 is 0.60
    (SamplingParams(top_p=0.3), {0}),               # the top token always stays
    (SamplingParams(min_p=0.4), {0, 1, 2}),         # threshold 0.14
    (SamplingParams(min_p=0.5), {0, 1}),            # threshold 0.175
    # top-p applies to the top-k renormalised distribution: 0.467, 0.333, 0.2,
    # so the mass before token 2 is 0.8 > 0.7 (on the raw probabilities, 0.6 < 0.7).
    (SamplingParams(top_k=3, top_p=0.7), {0, 1}),
    (SamplingParams(top_k=2, min_p=0.8), {0}),      # 0.25 / 0.35 = 0.71 < 0.8
])
def test_truncation_never_samples_an_excluded_token(params, allowed):
    torch.manual_seed(6)
    draws = 2000
    # Shuffled vocabulary positions, so the sort and scatter-back are exercised.
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    logits = torch.empty(len(TRUNCATION_PROBS))
    logits[perm] = torch.tensor(TRUNCATION_PROBS).log()
    batch = logits.expand(draws, -1).contiguous()
    out = sample(batch, [params] * draws).sampled_token_ids
    assert set(out.tolist()) == {int(perm[i]) for i in allowed}


def test_truncation_is_per_row():
    torch.manual_seed(7)
    logits = torch.tensor(TRUNCATION_PROBS).log().expand(3, -1).contiguous()
    params = [SamplingParams(top_k=1 + 1), SamplingParams(), SamplingParams(top_p=0.3)]
    seen = [set() for _ in params]
    for _ in range(300):
        out = sample(logits, params).sampled_token_ids.tolist()
        for row, token in enumerate(out):
            seen[row].add(token)
    assert seen[0] == {0, 1}
    assert len(seen[1]) >= 6
    assert seen[2] == {0}


# --- logit transforms: exact values ----------------------------------------------------------

PEN_LOGITS = [2.0, -1.0, 3.0, -2.0, 0.5, 1.0]
PROMPT = [1, 2]
OUTPUT = [2, 3, 3]


def _penalised(params):
    logits = torch.tensor([PEN_LOGITS, PEN_LOGITS])
    # Row 1 has no penalties and a different prompt length (padding is exercised).
    meta = metadata_for([params, SamplingParams()], 6, prompts=[PROMPT, [0, 4, 5]],
                        outputs=[OUTPUT, [0, 4]])
    assert not meta.no_penalties
    out = apply_penalties(logits, meta)
    assert out[1].tolist() == PEN_LOGITS
    return out[0].tolist()


def test_repetition_penalty_exact():
    # Tokens 1, 2 (prompt) and 2, 3 (output): positive / 2, negative * 2.
    assert _penalised(SamplingParams(repetition_penalty=2.0)) == pytest.approx(
        [2.0, -2.0, 1.5, -4.0, 0.5, 1.0])


def test_frequency_penalty_exact():
    # Output counts: token 2 once, token 3 twice; the prompt does not count.
    assert _penalised(SamplingParams(frequency_penalty=0.5)) == pytest.approx(
        [2.0, -1.0, 2.5, -3.0, 0.5, 1.0])


def test_presence_penalty_exact():
    assert _penalised(SamplingParams(presence_penalty=0.25)) == pytest.approx(
        [2.0, -1.0, 2.75, -2.25, 0.5, 1.0])


def test_all_penalties_combined_exact():
    # Repetition first, then frequency and presence.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    assert _penalised(params) == pytest.approx(
        [2.0, -2.0, 1.5 - 0.5 - 0.25, -4.0 - 1.0 - 0.25, 0.5, 1.0])


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [params], outputs=[[]]).sampled_token_ids.tolist() == [0]
    assert sample(logits, [params], outputs=[[0]]).sampled_token_ids.tolist() == [1]


def test_logit_bias_exact_and_per_row():
    logits = torch.zeros(3, 5)
    apply_logit_bias(logits, [{1: 2.5, 4: -100.0}, None, {0: 1.0}])
    assert logits.tolist() == [[0, 2.5, 0, 0, -100.0], [0] * 5, [1.0, 0, 0, 0, 0]]

    torch.manual_seed(8)
    raw = torch.randn(2, 5)
    out = sample(raw, [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
                       SamplingParams(temperature=0.0)])
    assert out.sampled_token_ids.tolist() == [3, int(raw[1].argmax())]


def test_bad_words_exact_and_per_row():
    logits = torch.zeros(3, 6)
    words = {0: [[2], [4, 5]], 2: [[1, 3, 5], [0, 4]]}
    apply_bad_words(logits, words, [[1, 4], [4], [3, 1, 3]])
    # row 0: [2] always, [4, 5] after a 4; row 1: no words; row 2: [1, 3, 5] after 1, 3 (not [0, 4])
    assert logits.tolist() == [[0, 0, -math.inf, 0, 0, -math.inf], [0] * 6, [0, 0, 0, 0, 0, -math.inf]]


def test_allowed_token_ids_and_bad_words_constrain_greedy_and_random_rows():
    torch.manual_seed(9)
    raw = torch.randn(3, 8)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[1, 6]),
              SamplingParams(temperature=0.0, _bad_words_token_ids=[[int(raw[1].argmax())]]),
              SamplingParams(seed=1, allowed_token_ids=[2, 3])]
    out = sample(raw, params, generators={2: torch.Generator().manual_seed(1)})
    best_allowed = 1 if raw[0, 1] >= raw[0, 6] else 6
    second = int(raw[1].topk(2).indices[1])
    assert out.sampled_token_ids.tolist()[:2] == [best_allowed, second]
    assert int(out.sampled_token_ids[2]) in (2, 3)


def test_min_tokens_blocks_eos_and_stop_ids():
    eos = 4
    logits = torch.tensor([[0.0, 1.0, 0.0, 9.0, 10.0]] * 4)
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)]
    outputs = [[0], [0, 1, 2], [], []]
    meta = metadata_for(params, 5, outputs=outputs, eos_token_id=eos)
    assert meta.min_tokens == {0: (3, {3, eos}), 3: (3, set())}
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    # Row 0 is under min_tokens: EOS (4) and stop id 3 are blocked.
    assert out == [1, eos, eos, eos]

    blocked = apply_min_tokens(torch.zeros(2, 5), {1: (2, {0, 4})})
    assert blocked.tolist() == [[0.0] * 5, [-math.inf, 0.0, 0.0, 0.0, -math.inf]]


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_with_ranks():
    torch.manual_seed(9)
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0.0, logprobs=4, logit_bias={0: 50.0}),
              SamplingParams(temperature=0.3, logprobs=2, presence_penalty=2.0),
              SamplingParams(temperature=1.5)]
    out = sample(logits, params, outputs=[[1], [1, 2], []])

    sampled = out.sampled_token_ids
    assert sampled[0] == 0  # the bias decided the token ...
    raw = torch.log_softmax(logits, dim=-1)  # ... but not the reported logprobs
    assert out.logprob_token_ids.shape == (3, 5) and out.logprobs.shape == (3, 5)
    assert out.logprob_token_ids.dtype == torch.int64
    assert out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    for row in range(3):
        order = raw[row].argsort(descending=True)
        assert out.logprob_token_ids[row, 1:].tolist() == order[:4].tolist()
        expected = raw[row, out.logprob_token_ids[row]]
        torch.testing.assert_close(out.logprobs[row], expected)
        assert int(out.ranks[row]) == order.tolist().index(int(sampled[row])) + 1


def test_compute_logprobs_with_topk_ties_and_k0():
    logprobs = torch.tensor([[-1.0, -0.5, -0.5, -3.0], [-2.0, -1.0, -0.1, -0.3]])
    ids, lps, ranks = compute_logprobs_with_topk(logprobs, torch.tensor([2, 0]), k=2)
    assert ids[:, 0].tolist() == [2, 0]
    assert lps[:, 0].tolist() == [-0.5, -2.0]
    assert ranks.tolist() == [1, 4]  # tie with the top: nothing strictly greater
    assert set(ids[0, 1:].tolist()) == {1, 2} and ids[1, 1:].tolist() == [2, 3]
    assert lps[1, 1:].tolist() == pytest.approx([-0.1, -0.3])

    ids, lps, ranks = compute_logprobs_with_topk(logprobs, torch.tensor([3, 3]), k=0)
    assert ids.shape == (2, 1) and lps[:, 0].tolist() == pytest.approx([-3.0, -0.3])
    assert ranks.tolist() == [4, 2]


def test_from_params_skips_unused_options():
    meta = metadata_for([SamplingParams(), SamplingParams(temperature=0.0)], 10)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.no_penalties and meta.prompt_token_ids is None
    assert not meta.all_greedy and not meta.all_random
    assert meta.max_num_logprobs is None

    meta = metadata_for([SamplingParams(top_k=3, logprobs=0), SamplingParams(top_k=-1)], 10,
                        prompts=[[1, 2, 3], [4]])
    assert meta.top_k.tolist() == [3, 10]
    assert meta.max_num_logprobs == 0


# --- the processor pipeline -----------------------------------------------------------------


class BanToken(LogitsProcessor):
    """A custom processor: token ``token_id`` is never sampled."""

    def __init__(self, token_id):
        self.token_id = token_id
        self.calls = 0

    def is_active(self, metadata):
        return True

    def apply(self, logits, metadata):
        self.calls += 1
        logits[:, self.token_id] = -math.inf
        return logits


def test_default_processors_run_in_vllm_order():
    names = [type(p).__name__ for p in Sampler().logits_processors]
    assert names == ["LogitBiasLogitsProcessor", "MinTokensLogitsProcessor",
                     "PenaltiesLogitsProcessor", "AllowedTokenIdsLogitsProcessor", "BadWordsLogitsProcessor",
                     "AllowedTokenBitmaskLogitsProcessor", "TemperatureLogitsProcessor", "TopKTopPLogitsProcessor"]
    assert [p.argmax_invariant for p in Sampler().logits_processors] == [False] * 6 + [True] * 2


def test_a_custom_processor_is_applied_and_disables_the_greedy_fast_path():
    torch.manual_seed(10)
    logits = torch.randn(3, 20)
    top = logits.argmax(-1)
    sampler = Sampler()
    ban = BanToken(int(top[0]))
    sampler.logits_processors.insert(0, ban)
    meta = metadata_for([SamplingParams(temperature=0.0)] * 3, 20)
    out = sampler(logits, meta).sampled_token_ids
    assert ban.calls == 1
    assert int(out[0]) == int(logits[0].topk(2).indices[1])  # the runner-up
    assert int(out[0]) != int(top[0]) and int(out[1]) != int(top[0])
    # Random rows never draw the banned token either.
    meta = metadata_for([SamplingParams(temperature=5.0)] * 3, 20)
    draws = torch.cat([sampler(torch.zeros(3, 20), meta).sampled_token_ids for _ in range(200)])
    assert int(top[0]) not in draws.tolist() and len(set(draws.tolist())) > 10


def test_the_plain_greedy_fast_path_leaves_inactive_processors_alone():
    class Counting(BanToken):
        def is_active(self, metadata):
            return False

    sampler = Sampler()
    counting = Counting(0)
    sampler.logits_processors.append(counting)
    logits = torch.tensor([[5.0, 1.0], [0.0, 2.0]])
    out = sampler(logits, metadata_for([SamplingParams(temperature=0.0)] * 2, 2))
    assert out.sampled_token_ids.tolist() == [0, 1] and counting.calls == 0


def _bitmask(allowed_rows, vocab):
    words = -(-vocab // 32)
    mask = torch.zeros(len(allowed_rows), words, dtype=torch.int64)
    for row, allowed in enumerate(allowed_rows):
        for t in allowed:
            mask[row, t // 32] |= 1 << (t % 32)
    # int32 words, bit 31 included (two's complement).
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def test_token_bitmask_exact_values():
    vocab = 70  # not a multiple of 32; tokens 31 and 63 use the sign bit
    allowed = [{0, 31, 32, 63, 69}, set(range(vocab))]
    logits = apply_token_bitmask(torch.zeros(2, vocab), _bitmask(allowed, vocab))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 32, 63, 69]
    assert torch.isfinite(logits[1]).all()


def test_allowed_token_bitmask_constrains_greedy_and_random_rows():
    torch.manual_seed(11)
    vocab = 40
    logits = torch.randn(2, vocab)
    meta = metadata_for([SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)], vocab)
    meta.allowed_token_bitmask = _bitmask([{3, 17, 35}, {1, 2, 33}], vocab)
    seen = set()
    for _ in range(100):
        out = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert out[0] == max((3, 17, 35), key=lambda t: float(logits[0, t]))
        seen.add(out[1])
    assert seen == {1, 2, 33}


def test_argmax_op_is_chosen_once_from_the_platform():
    """On CPU the kernel path is chosen at the first call (kernels available), never per call."""
    from pagedllm.kernels import cpu as cpu_kernels

    op = Argmax()
    logits = torch.randn(4, 33).to(torch.bfloat16)
    assert torch.equal(op(logits), logits.float().argmax(-1))
    if current_platform.is_cpu:
        expected = op.forward_cpu if cpu_kernels.is_available() else op.forward_native
    else:
        expected = op.forward_cuda
    assert op._forward_method == expected
    assert torch.equal(op.forward_native(logits), logits.float().argmax(-1))
