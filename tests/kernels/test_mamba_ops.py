"""The state-space ops of the Mamba-2 mixer (causal conv1d, the chunked SSD scan and its
one-token recurrence) against float64 token-by-token recurrences written here, on varlen
batches with ragged lengths, chunk boundaries, initial states per request and grouped B / C;
and the C++ CPU decode kernels against the PyTorch ops at every instruction-set level."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.mamba.ops import cpu_dispatch
from pagedllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
    causal_conv1d_update_native,
)
from pagedllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update, selective_state_update_native
from pagedllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined
from pagedllm.platforms import current_platform

NHEADS, HEAD_DIM, D_STATE, WIDTH, CONV_DIM = 4, 8, 16, 4, 24


# ---------------------------------------------------------------- float64 references


def ref_conv(x, weight, bias, state, activation):
    """One request: x [L, dim], state [dim, width - 1] -> (out [L, dim], new state), float64."""
    u = torch.cat((state.double(), x.double().T), dim=1)  # [dim, width - 1 + L]
    width = weight.shape[1]
    out = torch.stack([(u[:, t : t + width] * weight.double()).sum(1) for t in range(x.shape[0])])
    if bias is not None:
        out = out + bias.double()
    if activation:
        out = out * torch.sigmoid(out)
    return out, u[:, -(width - 1) :]


def ref_ssm(x, dt, A, B, C, D, z, dt_bias, state, softplus=True, limit=(0.0, math.inf)):
    """One request, token by token: x [L, H, P], dt [L, H], B / C [L, G, N], state [H, P, N]
    -> (y [L, H, P], final state), float64."""
    x, dt, B, C, s = x.double(), dt.double(), B.double(), C.double(), state.double().clone()
    dt = dt + dt_bias.double()
    if softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(*limit)
    per_group = x.shape[1] // B.shape[1]
    ys = []
    for t in range(x.shape[0]):
        b = B[t].repeat_interleave(per_group, 0)  # [H, N]
        c = C[t].repeat_interleave(per_group, 0)
        s = s * torch.exp(dt[t] * A.double())[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * b[:, None, :]
        y = (s * c[:, None, :]).sum(-1)
        if D is not None:
            y = y + x[t] * (D.double() if D.dim() == 2 else D.double()[:, None])
        if z is not None:
            y = y * F.silu(z[t].double())
        ys.append(y)
    return torch.stack(ys), s


# ---------------------------------------------------------------- inputs


def ssm_inputs(num_tokens, ngroups, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(num_tokens, NHEADS, HEAD_DIM, generator=g).to(dtype),
        dt=(torch.randn(num_tokens, NHEADS, generator=g) - 1.0).to(dtype),
        B=torch.randn(num_tokens, ngroups, D_STATE, generator=g).to(dtype),
        C=torch.randn(num_tokens, ngroups, D_STATE, generator=g).to(dtype),
    )


def ssm_params(seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(
        A=-torch.exp(torch.rand(NHEADS, generator=g) * 2),  # A_log in [0, 2]
        D=torch.rand(NHEADS, generator=g),
        dt_bias=torch.rand(NHEADS, generator=g) - 0.5,
    )


def qsl(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def assert_rel(actual, expected, rtol):
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3g} vs scale {scale:.3g} (rtol {rtol})"


# ---------------------------------------------------------------- chunked scan (prefill)


@pytest.mark.parametrize(
    "lens, chunk_size, ngroups, dtype, rtol",
    [
        ([1, 7, 64, 130], 32, 2, torch.float32, 1e-5),  # ragged, several chunks
        ([31, 32, 33, 63, 65], 32, 1, torch.float32, 1e-5),  # around chunk multiples
        ([3, 9, 2], 256, 2, torch.float32, 1e-5),  # every request shorter than a chunk
        ([1, 7, 64, 130], 16, 4, torch.bfloat16, 1e-2),
    ],
)
def test_chunk_scan_matches_sequential_recurrence(lens, chunk_size, ngroups, dtype, rtol):
    inputs, params = ssm_inputs(sum(lens), ngroups, dtype), ssm_params()
    num_reqs = len(lens)
    has_initial = torch.tensor([r % 2 == 1 for r in range(num_reqs)])
    slots = torch.randperm(num_reqs + 2, generator=torch.Generator().manual_seed(2))[:num_reqs].int()
    cache = torch.randn(num_reqs + 2, NHEADS, HEAD_DIM, D_STATE)
    cache[slots[~has_initial].long()] = math.nan  # fresh slots are never read
    before = cache.clone()
    out = mamba_chunk_scan_combined(
        inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], chunk_size, params["D"], None,
        params["dt_bias"], query_start_loc=qsl(lens), ssm_state=cache, state_batch_indices=slots,
        has_initial_state=has_initial, dt_softplus=True,
    )
    assert out.dtype == dtype and out.shape == inputs["x"].shape
    starts = qsl(lens).tolist()
    for r in range(num_reqs):
        tok = slice(starts[r], starts[r + 1])
        init = before[slots[r]] if has_initial[r] else torch.zeros(NHEADS, HEAD_DIM, D_STATE)
        y, final = ref_ssm(inputs["x"][tok], inputs["dt"][tok], params["A"], inputs["B"][tok], inputs["C"][tok],
                           params["D"], None, params["dt_bias"], init)
        assert_rel(out[tok], y, rtol)
        assert_rel(cache[slots[r]], final, rtol)
    untouched = [s for s in range(num_reqs + 2) if s not in slots.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def test_chunk_scan_gating_head_dim_skip_and_dt_limit():
    """z (y * silu(z)), D per channel [nheads, head_dim] and a dt clamp, on two requests."""
    lens = [5, 40]
    inputs, params = ssm_inputs(sum(lens), 2, torch.float32, seed=3), ssm_params(seed=4)
    z = torch.randn(sum(lens), NHEADS, HEAD_DIM)
    D = torch.randn(NHEADS, HEAD_DIM)
    cache = torch.zeros(2, NHEADS, HEAD_DIM, D_STATE)
    out = torch.empty_like(inputs["x"])
    got = mamba_chunk_scan_combined(
        inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], 16, D, z, params["dt_bias"],
        query_start_loc=qsl(lens), ssm_state=cache, dt_softplus=True, dt_limit=(0.3, 0.8), out=out,
    )
    assert got is out
    for r, tok in enumerate((slice(0, 5), slice(5, 45))):
        y, final = ref_ssm(inputs["x"][tok], inputs["dt"][tok], params["A"], inputs["B"][tok], inputs["C"][tok], D,
                           z[tok], params["dt_bias"], torch.zeros(NHEADS, HEAD_DIM, D_STATE), limit=(0.3, 0.8))
        assert_rel(out[tok], y, 1e-5)
        assert_rel(cache[r], final, 1e-5)


def test_chunk_scan_rejects_bad_shapes():
    inputs, params = ssm_inputs(8, 3, torch.float32), ssm_params()
    with pytest.raises(ValueError, match="multiple of ngroups"):
        mamba_chunk_scan_combined(inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], 4,
                                  query_start_loc=qsl([8]), ssm_state=torch.zeros(1, NHEADS, HEAD_DIM, D_STATE))


def test_conv_and_scan_match_transformers_mamba2_mixer():
    """The prefill ops in a Mamba-2 mixer's order (in_proj -> conv -> scan) give transformers'
    ``Mamba2Mixer`` its own pre-norm scan output: checkpoint layouts (conv weight [dim, 1,
    width], A_log, dt_bias, D) mean what the ops take."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    torch.manual_seed(16)
    config = Mamba2Config(hidden_size=32, num_heads=NHEADS, head_dim=HEAD_DIM, state_size=D_STATE, n_groups=2,
                          expand=1, conv_kernel=WIDTH, chunk_size=8, use_conv_bias=True)
    mixer = Mamba2Mixer(config, 0).eval()
    with torch.no_grad():
        mixer.A_log.uniform_(0, 2)
        mixer.dt_bias.uniform_(-1, 1)
        mixer.D.uniform_(0, 1)
    captured = []
    mixer.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach().clone()))
    num_tokens, inner, ngroups = 21, NHEADS * HEAD_DIM, 2
    conv_dim = inner + 2 * ngroups * D_STATE
    hidden = torch.randn(1, num_tokens, 32)
    with torch.no_grad():
        mixer(hidden)
        xbc, dt = mixer.in_proj(hidden)[0, :, inner:].split([conv_dim, NHEADS], dim=-1)
        start = qsl([num_tokens])
        xbc = causal_conv1d_fn(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, torch.zeros(1, conv_dim, WIDTH - 1),
                               start, activation="silu")
        x, B, C = xbc.split([inner, ngroups * D_STATE, ngroups * D_STATE], dim=-1)
        y = mamba_chunk_scan_combined(
            x.reshape(num_tokens, NHEADS, HEAD_DIM), dt, -torch.exp(mixer.A_log), B.reshape(num_tokens, ngroups, D_STATE),
            C.reshape(num_tokens, ngroups, D_STATE), 8, mixer.D, None, mixer.dt_bias, query_start_loc=start,
            ssm_state=torch.zeros(1, NHEADS, HEAD_DIM, D_STATE), dt_softplus=True,
        )
    torch.testing.assert_close(y, captured[0][0].reshape(num_tokens, NHEADS, HEAD_DIM), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- causal conv1d


def conv_params(dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CONV_DIM, WIDTH, generator=g).to(dtype), torch.randn(CONV_DIM, generator=g).to(dtype)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_fn_ragged_with_states(activation):
    """Lengths 1 and 2 (fewer than width - 1: the old state shifts into the new one), 7 and 20;
    initial states on for some requests; states written back to their slots."""
    lens = [1, 7, 2, 20]
    weight, bias = conv_params(torch.float32)
    x = torch.randn(sum(lens), CONV_DIM)
    cache = torch.randn(6, CONV_DIM, WIDTH - 1)
    slots = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    has_initial = torch.tensor([True, False, True, True])
    cache[0] = math.nan  # request 1's fresh slot: never read
    before = cache.clone()
    out = causal_conv1d_fn(x, weight, bias, cache, qsl(lens), slots, has_initial, activation)
    starts = qsl(lens).tolist()
    for r in range(len(lens)):
        tok = slice(starts[r], starts[r + 1])
        init = before[slots[r]] if has_initial[r] else torch.zeros(CONV_DIM, WIDTH - 1)
        expected, state = ref_conv(x[tok], weight, bias, init, activation)
        torch.testing.assert_close(out[tok].double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache[slots[r]].double(), state, rtol=0, atol=0)
    assert torch.equal(cache[[1, 3]], before[[1, 3]])


# ---------------------------------------------------------------- prefill, then decode


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_prefill_then_decode_equals_one_prefill(dtype, rtol):
    """Conv and scan over 45 tokens at once equal: 20 tokens, a second prefill chunk of 17
    from the cached states, then 8 decode steps (``causal_conv1d_update`` and
    ``selective_state_update``), in a two-request batch with the other request decoding."""
    total, first, second = 45, 20, 17
    inputs, params = ssm_inputs(total, 2, dtype, seed=6), ssm_params(seed=7)
    weight, bias = conv_params(dtype, seed=8)
    xc = torch.randn(total, CONV_DIM).to(dtype)

    def fresh():
        return torch.zeros(3, CONV_DIM, WIDTH - 1, dtype=dtype), torch.zeros(3, NHEADS, HEAD_DIM, D_STATE)

    def prefill(conv_cache, ssm_cache, tok, has_initial):
        n = tok.stop - tok.start
        slots, init = torch.tensor([1], dtype=torch.int32), torch.tensor([has_initial])
        conv = causal_conv1d_fn(xc[tok], weight, bias, conv_cache, qsl([n]), slots, init, "silu")
        y = mamba_chunk_scan_combined(
            inputs["x"][tok], inputs["dt"][tok], params["A"], inputs["B"][tok], inputs["C"][tok], 8, params["D"],
            None, params["dt_bias"], query_start_loc=qsl([n]), ssm_state=ssm_cache, state_batch_indices=slots,
            has_initial_state=init, dt_softplus=True,
        )
        return conv, y

    conv_cache, ssm_cache = fresh()
    conv_all, y_all = prefill(conv_cache, ssm_cache, slice(0, total), False)

    conv_cache, ssm_cache = fresh()
    conv_a, y_a = prefill(conv_cache, ssm_cache, slice(0, first), False)
    conv_b, y_b = prefill(conv_cache, ssm_cache, slice(first, first + second), True)
    convs, ys = [conv_a, conv_b], [y_a, y_b]
    other = torch.randn(1, CONV_DIM).to(dtype)  # the batch's other request, in slot 2
    for t in range(first + second, total):
        batch = torch.cat((other, xc[t : t + 1]))
        slots = torch.tensor([2, 1], dtype=torch.int32)
        convs.append(causal_conv1d_update(batch, conv_cache, weight, bias, "silu", slots)[1:])
        pick = lambda name: torch.cat((inputs[name][t : t + 1], inputs[name][t : t + 1]))  # noqa: E731
        y = selective_state_update(ssm_cache, pick("x"), pick("dt"), params["A"], pick("B"), pick("C"), params["D"],
                                   None, params["dt_bias"], True, slots)
        ys.append(y[1:])
    torch.testing.assert_close(torch.cat(convs), conv_all, rtol=rtol, atol=rtol)
    assert_rel(torch.cat(ys).float(), y_all.double(), rtol)
    _, final = ref_ssm(inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params["D"], None,
                       params["dt_bias"], torch.zeros(NHEADS, HEAD_DIM, D_STATE))
    assert_rel(ssm_cache[1], final, rtol)


# ---------------------------------------------------------------- one-token recurrence


def decode_inputs(batch, ngroups, dtype, seed=9):
    inputs = ssm_inputs(batch, ngroups, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    inputs["z"] = torch.randn(batch, NHEADS, HEAD_DIM, generator=g).to(dtype)
    inputs["state"] = torch.randn(batch + 3, NHEADS, HEAD_DIM, D_STATE, generator=g)
    inputs["slots"] = torch.randperm(batch + 3, generator=g)[:batch].int()
    return inputs


def test_selective_state_update_matches_recurrence_and_vllm_forms():
    """Per-head dt / A / D / dt_bias, and vLLM's expanded forms of them, give one answer."""
    d, params = decode_inputs(5, 2, torch.float32), ssm_params()
    expected, states = [], []
    for b in range(5):
        y, s = ref_ssm(d["x"][b : b + 1], d["dt"][b : b + 1], params["A"], d["B"][b : b + 1], d["C"][b : b + 1],
                       params["D"], d["z"][b : b + 1], params["dt_bias"], d["state"][d["slots"][b]])
        expected.append(y[0])
        states.append(s)
    state = d["state"].clone()
    out = selective_state_update(state, d["x"], d["dt"], params["A"], d["B"], d["C"], params["D"], d["z"],
                                 params["dt_bias"], True, d["slots"])
    assert_rel(out, torch.stack(expected), 1e-5)
    assert_rel(state[d["slots"].long()], torch.stack(states), 1e-5)
    state = d["state"].clone()
    out_vllm = selective_state_update(
        state, d["x"], d["dt"][:, :, None].expand(-1, -1, HEAD_DIM),
        params["A"][:, None, None].expand(-1, HEAD_DIM, D_STATE),
        d["B"], d["C"], params["D"][:, None].expand(-1, HEAD_DIM), d["z"],
        params["dt_bias"][:, None].expand(-1, HEAD_DIM), True, d["slots"],
    )
    torch.testing.assert_close(out_vllm, out, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- C++ CPU decode kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_match_torch_ops(isa_kernel, dtype):
    """``causal_conv1d_update`` and ``selective_state_update`` kernels equal the PyTorch
    ops (dims with vector tails: conv dim 24 + 5, head_dim 8 / d_state 16 and 12)."""
    torch.manual_seed(10)
    batch, dim = 6, CONV_DIM + 5
    g = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(dim, WIDTH, generator=g).to(dtype), torch.randn(dim, generator=g).to(dtype)
    x = torch.randn(batch, dim, generator=g).to(dtype)
    cache = torch.randn(batch + 2, dim, WIDTH - 1, generator=g).to(dtype)
    slots = torch.tensor([7, 0, 3, 5, 1, 2], dtype=torch.int32)
    for act in (None, "silu"):
        for b in (bias, None):
            got_cache, want_cache = cache.clone(), cache.clone()
            got = isa_kernel.causal_conv1d_update(x, got_cache, weight, b, act is not None, slots)
            want = causal_conv1d_update_native(x, want_cache, weight, b, act, slots.long())
            torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
            assert torch.equal(got_cache, want_cache)

    params = ssm_params(seed=12)
    for d_state, ngroups, use_z in ((D_STATE, 2, True), (12, 4, False)):
        d = decode_inputs(batch, ngroups, dtype, seed=13)
        d["B"], d["C"] = d["B"][..., :d_state].contiguous(), d["C"][..., :d_state].contiguous()
        state = d["state"][..., :d_state].contiguous()
        z = d["z"] if use_z else None
        got_state, want_state = state.clone(), state.clone()
        got = isa_kernel.selective_state_update(got_state, d["x"], d["dt"], params["A"], d["B"], d["C"], params["D"],
                                                z, params["dt_bias"], True, d["slots"], 0.0, math.inf)
        want = selective_state_update_native(want_state, d["x"], d["dt"], params["A"], d["B"], d["C"], params["D"],
                                             z, params["dt_bias"], True, d["slots"].long())
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def test_decode_ops_dispatch_to_kernels(isa_kernel):
    """On the CPU platform the public decode ops run the kernels at vector levels, and
    PyTorch's code at the portable one and on other platforms (``cpu_dispatch``): their
    outputs are those, bit for bit."""
    vector_level = current_platform.is_cpu and isa_kernel.active_isa() != "portable"
    assert cpu_dispatch.use_kernels() == vector_level
    d, params = decode_inputs(3, 2, torch.float32, seed=14), ssm_params(seed=15)
    args = (d["x"], d["dt"], params["A"], d["B"], d["C"], params["D"], d["z"], params["dt_bias"], True)
    public_state, kernel_state, native_state = d["state"].clone(), d["state"].clone(), d["state"].clone()
    public = selective_state_update(public_state, *args, d["slots"])
    if vector_level:
        expected = isa_kernel.selective_state_update(kernel_state, *args, d["slots"], -math.inf, math.inf)
    else:
        expected = selective_state_update_native(native_state, *args, d["slots"].long())
    assert torch.equal(public, expected)
    weight, bias = conv_params(torch.float32)
    x, cache = torch.randn(3, CONV_DIM), torch.randn(4, CONV_DIM, WIDTH - 1)
    slots = torch.tensor([3, 1, 0], dtype=torch.int32)
    public_cache, other_cache = cache.clone(), cache.clone()
    public = causal_conv1d_update(x, public_cache, weight, bias, "silu", slots)
    if vector_level:
        expected = isa_kernel.causal_conv1d_update(x, other_cache, weight, bias, True, slots)
    else:
        expected = causal_conv1d_update_native(x, other_cache, weight, bias, "silu", slots.long())
    assert torch.equal(public, expected) and torch.equal(public_cache, other_cache)
