"""The gated delta rule ops (``pagedllm.model_executor.layers.mamba.ops.gated_delta``) equal a
float64 token-by-token recurrence written here: ragged requests across 64-token block bounds,
with and without initial states, grouped value heads, L2-normed q/k, and a prefill followed by
decode steps equal to one prefill of the whole sequence; and the C++ CPU kernels
(``gated_delta.cpp``) equal that recurrence at every instruction-set level, the public ops
running them where the engine's decision (``cpu_dispatch.use_kernels``) says so."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers.mamba.ops import cpu_dispatch
from pagedllm.model_executor.layers.mamba.ops.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_native,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_native,
)
from pagedllm.platforms import current_platform

K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8
TOL = dict(atol=2e-5, rtol=2e-5)


def reference(q, k, v, g, beta, state, l2norm):
    """Token by token in float64: q, k [L, H, K], v [L, HV, V], g, beta [L, HV], state [HV, K, V]
    -> (out [L, HV, V], final state)."""
    group = v.shape[1] // k.shape[1]
    q, k = (x.double().repeat_interleave(group, dim=1) for x in (q, k))
    if l2norm:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    state, out = state.double().clone(), []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        correction = beta[t].double()[:, None] * (v[t].double() - predicted)
        state = state + torch.einsum("hk,hv->hkv", k[t], correction)
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


def random_inputs(num_tokens, seed, v_dim=V_DIM):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(num_tokens, K_HEADS, K_DIM, generator=gen) for _ in range(2))
    v = torch.randn(num_tokens, V_HEADS, v_dim, generator=gen)
    g = -torch.rand(num_tokens, V_HEADS, generator=gen) * 0.5  # log decay in (-0.5, 0]
    beta = torch.rand(num_tokens, V_HEADS, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_prefill_equals_the_recurrence(l2norm):
    # Ragged requests: one token, inside one block, exactly one block, across two and three block bounds.
    lengths = [1, 37, 64, 65, 150]
    initial = [False, True, False, True, True]
    slots = [3, 0, 5, 2, 4]
    q, k, v, g, beta = random_inputs(sum(lengths), seed=0)
    if not l2norm:  # unnormalised keys: keep the recurrence contractive
        q, k = q * 0.25, k * 0.25
    states = torch.randn(6, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(1))
    before = states.clone()
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = chunk_gated_delta_rule(q, k, v, g, beta, states, bounds, torch.tensor(slots, dtype=torch.int32),
                                 torch.tensor(initial), use_qk_l2norm_in_kernel=l2norm)
    assert out.shape == v.shape and out.dtype == v.dtype
    for r, (slot, has_state) in enumerate(zip(slots, initial)):
        tokens = slice(bounds[r], bounds[r + 1])
        start = before[slot] if has_state else torch.zeros_like(before[slot])
        want_out, want_state = reference(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], start, l2norm)
        torch.testing.assert_close(out[tokens].double(), want_out, **TOL)
        torch.testing.assert_close(states[slot].double(), want_state, **TOL)
    torch.testing.assert_close(states[1], before[1], rtol=0, atol=0)  # no request's slot: untouched


def test_prefill_then_decode_equals_one_prefill():
    prompt, steps, slots = 70, 5, torch.tensor([1, 0], dtype=torch.int32)
    inputs = [random_inputs(prompt + steps, seed=s) for s in (2, 3)]
    # The whole sequences in one prefill each (requests in slots 1 and 0).
    whole = [torch.cat(parts) for parts in zip(*inputs)]
    full_states = torch.zeros(2, V_HEADS, K_DIM, V_DIM)
    bounds = torch.tensor([0, prompt + steps, 2 * (prompt + steps)], dtype=torch.int32)
    full = chunk_gated_delta_rule(*whole, full_states, bounds, slots, torch.tensor([False, False]),
                                  use_qk_l2norm_in_kernel=True)
    # The prompts, then one decode step at a time for both requests.
    states = torch.full((2, V_HEADS, K_DIM, V_DIM), float("nan"))  # stale slots: must not be read
    head = [torch.cat([x[:prompt] for x in parts]) for parts in zip(*inputs)]
    bounds = torch.tensor([0, prompt, 2 * prompt], dtype=torch.int32)
    prefill = chunk_gated_delta_rule(*head, states, bounds, slots, torch.tensor([False, False]),
                                     use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(prefill[:prompt], full[:prompt], **TOL)
    for t in range(prompt, prompt + steps):
        step = [torch.stack([x[t] for x in parts]) for parts in zip(*inputs)]
        out = fused_recurrent_gated_delta_rule(*step, states, slots, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[0], full[t], **TOL)
        torch.testing.assert_close(out[1], full[prompt + steps + t], **TOL)
    torch.testing.assert_close(states, full_states, **TOL)


def test_chunked_prefill_resumes_from_its_state():
    # A prompt cut into chunks of 16 tokens (the engine's chunked prefill) equals it in one piece.
    q, k, v, g, beta = random_inputs(100, seed=4)
    one = torch.zeros(1, V_HEADS, K_DIM, V_DIM)
    whole = chunk_gated_delta_rule(q, k, v, g, beta, one, torch.tensor([0, 100], dtype=torch.int32),
                                   torch.tensor([0], dtype=torch.int32), torch.tensor([False]),
                                   use_qk_l2norm_in_kernel=True)
    pieces = torch.zeros(1, V_HEADS, K_DIM, V_DIM)
    for start in range(0, 100, 16):
        tokens = slice(start, min(start + 16, 100))
        n = tokens.stop - start
        out = chunk_gated_delta_rule(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], pieces,
                                     torch.tensor([0, n], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                     torch.tensor([start > 0]), use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, whole[tokens], **TOL)
    torch.testing.assert_close(pieces, one, **TOL)


def test_bad_shapes_are_refused():
    q, k, v, g, beta = random_inputs(4, seed=5)
    states = torch.zeros(1, V_HEADS, K_DIM, V_DIM)
    with pytest.raises(ValueError, match="ssm_state"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, states[:, :2], torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="query_start_loc"):
        chunk_gated_delta_rule(q, k, v, g, beta, states, torch.tensor([0, 3], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), torch.tensor([False]))


# ---------------------------------------------------------------- C++ CPU kernels

#: A value head dim with vector tails at both widths (16 + 4 and 2 x 8 + 4).
KERNEL_V_DIM = 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kernels_equal_the_recurrence(isa_kernel, dtype):
    """Prefill over ragged requests (one token, inside a 64-token block, exactly one, across
    two block bounds) from zero and initial float32 states, then two decode steps of every
    request, against the float64 recurrence; a state of the inputs' dtype against the PyTorch
    ops, which round it at the same points."""
    lengths, initial, slots = [1, 37, 64, 130], [False, True, True, False], [3, 0, 5, 2]
    steps = 2
    q, k, v, g, beta = random_inputs(sum(lengths) + steps * len(lengths), seed=6, v_dim=KERNEL_V_DIM)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    n = sum(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    start = torch.randn(6, V_HEADS, K_DIM, KERNEL_V_DIM, generator=torch.Generator().manual_seed(7))
    states = start.clone()
    slot_t, initial_t = torch.tensor(slots, dtype=torch.int32), torch.tensor(initial)
    out = isa_kernel.gated_delta_rule_prefill(q[:n], k[:n], v[:n], g[:n], beta[:n], states, bounds, slot_t, initial_t,
                                              K_DIM ** -0.5, True)
    decoded = []
    for step in range(steps):
        t = slice(n + step * len(lengths), n + (step + 1) * len(lengths))
        decoded.append(isa_kernel.gated_delta_rule_decode(q[t], k[t], v[t], g[t], beta[t], states, slot_t,
                                                          K_DIM ** -0.5, True))
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert out.dtype == dtype and out.shape == v[:n].shape
    for r, (slot, has_state) in enumerate(zip(slots, initial)):
        rows = [*range(bounds[r], bounds[r + 1]), *(n + s * len(lengths) + r for s in range(steps))]
        first = start[slot] if has_state else torch.zeros_like(start[slot])
        want_out, want_state = reference(q[rows], k[rows], v[rows], g[rows], beta[rows], first, True)
        got_out = torch.cat([out[bounds[r]:bounds[r + 1]], *(d[r:r + 1] for d in decoded)])
        torch.testing.assert_close(got_out.double(), want_out, **tol)
        torch.testing.assert_close(states[slot].double(), want_state, **TOL if dtype == torch.float32 else tol)
    assert torch.equal(states[[1, 4]], start[[1, 4]])  # no request's slots: untouched
    if dtype == torch.float32:
        return
    kernel_state, native_state = start.to(dtype), start.to(dtype)
    got = isa_kernel.gated_delta_rule_prefill(q[:n], k[:n], v[:n], g[:n], beta[:n], kernel_state, bounds, slot_t,
                                              initial_t, K_DIM ** -0.5, True)
    want = chunk_gated_delta_rule_native(q[:n], k[:n], v[:n], g[:n], beta[:n], native_state, bounds.tolist(), slots,
                                         initial, None, True)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kernel_state.float(), native_state.float(), atol=2e-2, rtol=2e-2)


def test_kernels_refuse_bad_inputs(isa_kernel):
    q, k, v, g, beta = random_inputs(3, seed=8)
    states = torch.zeros(2, V_HEADS, K_DIM, V_DIM)
    with pytest.raises(RuntimeError, match="slot index 2 out of range"):
        isa_kernel.gated_delta_rule_decode(q, k, v, g, beta, states, torch.tensor([0, 1, 2]), 1.0, True)
    with pytest.raises(RuntimeError, match="query_start_loc must end at num_tokens 3"):
        isa_kernel.gated_delta_rule_prefill(q, k, v, g, beta, states, torch.tensor([0, 2]), torch.tensor([0]),
                                            torch.tensor([False]), 1.0, True)
    with pytest.raises(RuntimeError, match="state must be"):
        isa_kernel.gated_delta_rule_decode(q, k, v, g, beta, states[..., :4], torch.tensor([0, 1, 0]), 1.0, True)


def test_public_ops_dispatch_to_kernels(isa_kernel):
    """On the CPU platform the public ops run the kernels at vector levels and PyTorch's code
    at the portable one (``cpu_dispatch``): their outputs are those, bit for bit."""
    vector_level = current_platform.is_cpu and isa_kernel.active_isa() != "portable"
    assert cpu_dispatch.use_kernels() == vector_level
    q, k, v, g, beta = random_inputs(9, seed=9)
    bounds, slots, initial = torch.tensor([0, 2, 9], dtype=torch.int32), torch.tensor([1, 0]), torch.tensor([True, False])
    start = torch.randn(2, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(10))
    public_state, other_state = start.clone(), start.clone()
    public = chunk_gated_delta_rule(q, k, v, g, beta, public_state, bounds, slots, initial, use_qk_l2norm_in_kernel=True)
    if vector_level:
        other = isa_kernel.gated_delta_rule_prefill(q, k, v, g, beta, other_state, bounds, slots, initial,
                                                    K_DIM ** -0.5, True)
    else:
        other = chunk_gated_delta_rule_native(q, k, v, g, beta, other_state, [0, 2, 9], [1, 0], [True, False],
                                              None, True)
    assert torch.equal(public, other) and torch.equal(public_state, other_state)
    public = fused_recurrent_gated_delta_rule(q[:2], k[:2], v[:2], g[:2], beta[:2], public_state, slots,
                                              use_qk_l2norm_in_kernel=True)
    if vector_level:
        other = isa_kernel.gated_delta_rule_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], other_state, slots,
                                                   K_DIM ** -0.5, True)
    else:
        other = fused_recurrent_gated_delta_rule_native(q[:2], k[:2], v[:2], g[:2], beta[:2], other_state, slots,
                                                        None, True)
    assert torch.equal(public, other) and torch.equal(public_state, other_state)
