"""The gated delta rule ops (``pagedllm.model_executor.layers.mamba.ops.gated_delta``) equal a
float64 token-by-token recurrence written here: ragged requests across 64-token block bounds,
with and without initial states, grouped value heads, L2-normed q/k, and a prefill followed by
decode steps equal to one prefill of the whole sequence."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.layers.mamba.ops.gated_delta import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

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


def random_inputs(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(num_tokens, K_HEADS, K_DIM, generator=gen) for _ in range(2))
    v = torch.randn(num_tokens, V_HEADS, V_DIM, generator=gen)
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
