// Mamba-2's decode step for CPU: the depthwise causal conv against each request's conv state,
// and the state-space recurrence, each one fused pass per request (and head) over its state.
//
// Registered as torch.ops.pagedllm_cpu_<level>.* (see ops.py); the PyTorch ops of
// pagedllm/model_executor/layers/mamba/ops/ (causal_conv1d.py, mamba_ssm.py) are the
// reference, and their docstrings the contract:
//
//   causal_conv1d_update    x [B, dim], conv_states [slots, dim, width - 1] (x's dtype), weight
//                           [dim, width], bias [dim] or none -> out [B, dim]:
//                           out = act(bias + sum_k weight[:, k] * [state | x][:, k]); the state
//                           rolled by one in place (oldest input out, x in)
//   selective_state_update  state [slots, H, P, N] float32; x [B, H, P], dt [B, H], B / C
//                           [B, G, N], z [B, H, P] or none (x's dtype); A, D, dt_bias [H]
//                           float32 -> out [B, H, P]:
//                           dt' = clamp(softplus?(dt + dt_bias)), S = exp(dt' A) S + dt' x B^T,
//                           out = (S C + D x) * silu?(z)
//
// Sums in float32, outputs rounded once to x's dtype. A decode step's state is too small to
// be worth a GEMM: the time is the state's one read and write, and PyTorch's dozen ops (each a
// pass over the state or a gather / scatter of the slots) are what this replaces. Work is split
// over ATen's pool by request (conv) or (request, head) (recurrence), a grain of about 32k
// elements, so a small step stays on the calling thread. The recurrence's rows run 16 (AVX-512)
// or 8 (AVX2) states at a time (simd.h); tails and portable builds use the scalar loop.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kGrainElements = 32768;

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// The slot of request i: indices int32 or int64, checked against the cache's slots.
int64_t slot_of(const at::Tensor& indices, int64_t i, int64_t num_slots) {
  const int64_t slot = indices.scalar_type() == at::kInt ? indices.const_data_ptr<int32_t>()[i]
                                                         : indices.const_data_ptr<int64_t>()[i];
  TORCH_CHECK(slot >= 0 && slot < num_slots, "slot index ", slot, " out of range [0, ", num_slots, ")");
  return slot;
}

void check_indices(const at::Tensor& indices, int64_t batch, const char* name) {
  TORCH_CHECK(indices.dim() == 1 && indices.size(0) == batch && indices.is_contiguous(), name,
              ": slot indices must be contiguous [batch]");
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong, name,
              ": slot indices must be int32 or int64");
}

template <typename T>
void conv_update_impl(at::Tensor& out, const at::Tensor& x, at::Tensor& states, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias, bool act, const at::Tensor& indices) {
  const int64_t batch = x.size(0), dim = x.size(1), width = weight.size(1), keep = width - 1;
  const int64_t xs = x.stride(0), ss0 = states.stride(0), ss1 = states.stride(1), num_slots = states.size(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* sp = states.mutable_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b) slot_of(indices, b, num_slots);  // checked before any write
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, dim * width));
  at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      T* state = sp + slot_of(indices, b, num_slots) * ss0;
      const T* xr = xp + b * xs;
      T* o = op + b * dim;
      for (int64_t d = 0; d < dim; ++d) {
        T* s = state + d * ss1;
        const T* w = wp + d * width;
        const float xv = static_cast<float>(xr[d]);
        float acc = bp ? static_cast<float>(bp[d]) : 0.f;
        for (int64_t k = 0; k < keep; ++k) acc += static_cast<float>(w[k]) * static_cast<float>(s[k]);
        acc += static_cast<float>(w[keep]) * xv;
        for (int64_t k = 0; k + 1 < keep; ++k) s[k] = s[k + 1];
        s[keep - 1] = xr[d];
        o[d] = static_cast<T>(act ? silu(acc) : acc);
      }
    }
  });
}

// One row of a head's state: S[n] = decay * S[n] + dx * B[n]; returns sum_n S[n] * C[n].
inline float update_row(float* s, const float* bv, const float* cv, int64_t n, float decay, float dx) {
  int64_t i = 0;
  float acc = 0.f;
#ifdef PAGEDLLM_VEC
  using namespace pagedllm_simd;
  VecF vacc = vset1(0.f);
  const VecF vdecay = vset1(decay), vdx = vset1(dx);
  for (; i + kVecWidth <= n; i += kVecWidth) {
    const VecF si = vfmadd(vload(s + i), vdecay, vload(bv + i) * vdx);
    vstore(s + i, si);
    vacc = vfmadd(si, vload(cv + i), vacc);
  }
  acc = vreduce_add(vacc);
#endif
  for (; i < n; ++i) {
    s[i] = s[i] * decay + dx * bv[i];
    acc += s[i] * cv[i];
  }
  return acc;
}

struct RecurrenceArgs {
  bool softplus;
  float dt_min, dt_max;
};

template <typename T>
void ssm_update_impl(at::Tensor& out, at::Tensor& state, const at::Tensor& x, const at::Tensor& dt,
                     const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const c10::optional<at::Tensor>& D,
                     const c10::optional<at::Tensor>& z, const c10::optional<at::Tensor>& dt_bias,
                     const at::Tensor& indices, RecurrenceArgs args) {
  const int64_t batch = x.size(0), heads = x.size(1), hdim = x.size(2), n = state.size(3);
  const int64_t groups = B.size(1), per_group = heads / groups, num_slots = state.size(0);
  const int64_t st0 = state.stride(0), st1 = state.stride(1), st2 = state.stride(2);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), dts0 = dt.stride(0), dts1 = dt.stride(1);
  const int64_t bs0 = B.stride(0), bs1 = B.stride(1), cs0 = C.stride(0), cs1 = C.stride(1);
  const int64_t zs0 = z.has_value() ? z->stride(0) : 0, zs1 = z.has_value() ? z->stride(1) : 0;
  const T* xp = x.const_data_ptr<T>();
  const T* dtp = dt.const_data_ptr<T>();
  const T* bp = B.const_data_ptr<T>();
  const T* cp = C.const_data_ptr<T>();
  const T* zp = z.has_value() ? z->const_data_ptr<T>() : nullptr;
  const float* ap = A.const_data_ptr<float>();
  const float* dp = D.has_value() ? D->const_data_ptr<float>() : nullptr;
  const float* biasp = dt_bias.has_value() ? dt_bias->const_data_ptr<float>() : nullptr;
  float* sp = state.mutable_data_ptr<float>();
  T* op = out.mutable_data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b) slot_of(indices, b, num_slots);  // checked before any write
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, hdim * n));
  at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> bc(2 * n);  // this (request, group)'s B and C in float32
    int64_t widened = -1;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / heads, h = r % heads, g = h / per_group;
      if (widened != b * groups + g) {
        widened = b * groups + g;
        for (int64_t i = 0; i < n; ++i) {
          bc[i] = static_cast<float>(bp[b * bs0 + g * bs1 + i]);
          bc[n + i] = static_cast<float>(cp[b * cs0 + g * cs1 + i]);
        }
      }
      float dtv = static_cast<float>(dtp[b * dts0 + h * dts1]) + (biasp ? biasp[h] : 0.f);
      if (args.softplus) dtv = dtv <= 20.f ? std::log1p(std::exp(dtv)) : dtv;
      dtv = std::min(std::max(dtv, args.dt_min), args.dt_max);
      const float decay = std::exp(dtv * ap[h]);
      float* s = sp + slot_of(indices, b, num_slots) * st0 + h * st1;
      const T* xr = xp + b * xs0 + h * xs1;
      const T* zr = zp ? zp + b * zs0 + h * zs1 : nullptr;
      T* o = op + (b * heads + h) * hdim;
      for (int64_t p = 0; p < hdim; ++p) {
        const float xv = static_cast<float>(xr[p]);
        float y = update_row(s + p * st2, bc.data(), bc.data() + n, n, decay, dtv * xv);
        if (dp) y += dp[h] * xv;
        if (zr) y *= silu(static_cast<float>(zr[p]));
        o[p] = static_cast<T>(y);
      }
    }
  });
}

at::Tensor causal_conv1d_update(const at::Tensor& x, at::Tensor& conv_states, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, bool silu_activation,
                                const at::Tensor& cache_indices) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "causal_conv1d_update: x must be [batch, dim], dim contiguous");
  const int64_t dim = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim && weight.size(1) >= 2 && weight.is_contiguous(),
              "causal_conv1d_update: weight must be contiguous [dim, width], width >= 2");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == dim && conv_states.size(2) == weight.size(1) - 1 &&
                  conv_states.stride(2) == 1,
              "causal_conv1d_update: conv_states must be [slots, dim, width - 1], last dimension contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == dim && bias->is_contiguous()),
              "causal_conv1d_update: bias must be contiguous [dim]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && conv_states.scalar_type() == dtype &&
                  (!bias.has_value() || bias->scalar_type() == dtype),
              "causal_conv1d_update: x, conv_states, weight and bias must have one dtype");
  check_indices(cache_indices, x.size(0), "causal_conv1d_update");
  at::Tensor out = at::empty({x.size(0), dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "causal_conv1d_update", [&] {
    conv_update_impl<scalar_t>(out, x, conv_states, weight, bias, silu_activation, cache_indices);
  });
  return out;
}

void check_per_head(const c10::optional<at::Tensor>& t, int64_t heads, const char* what) {
  TORCH_CHECK(!t.has_value() || (t->dim() == 1 && t->size(0) == heads && t->is_contiguous() &&
                                 t->scalar_type() == at::kFloat),
              "selective_state_update: ", what, " must be contiguous float32 [nheads]");
}

at::Tensor selective_state_update(at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                  const at::Tensor& B, const at::Tensor& C, const c10::optional<at::Tensor>& D,
                                  const c10::optional<at::Tensor>& z, const c10::optional<at::Tensor>& dt_bias,
                                  bool dt_softplus, const at::Tensor& state_batch_indices, double dt_min,
                                  double dt_max) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.stride(3) == 1,
              "selective_state_update: state must be float32 [slots, nheads, head_dim, d_state], d_state contiguous");
  const int64_t heads = state.size(1), hdim = state.size(2), n = state.size(3);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == hdim && x.stride(2) == 1,
              "selective_state_update: x must be [batch, nheads, head_dim], head_dim contiguous");
  const int64_t batch = x.size(0);
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == batch && dt.size(1) == heads, "selective_state_update: dt must be [batch, nheads]");
  TORCH_CHECK(B.dim() == 3 && B.size(0) == batch && B.size(1) >= 1 && heads % B.size(1) == 0 && B.size(2) == n &&
                  B.stride(2) == 1 && C.sizes() == B.sizes() && C.stride(2) == 1,
              "selective_state_update: B and C must be [batch, ngroups, d_state], d_state contiguous, nheads a "
              "multiple of ngroups");
  TORCH_CHECK(!z.has_value() || (z->sizes() == x.sizes() && z->stride(2) == 1),
              "selective_state_update: z must have x's shape, head_dim contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dt.scalar_type() == dtype && B.scalar_type() == dtype && C.scalar_type() == dtype &&
                  (!z.has_value() || z->scalar_type() == dtype),
              "selective_state_update: x, dt, B, C and z must have one dtype");
  check_per_head(A, heads, "A");
  check_per_head(D, heads, "D");
  check_per_head(dt_bias, heads, "dt_bias");
  check_indices(state_batch_indices, batch, "selective_state_update");
  at::Tensor out = at::empty({batch, heads, hdim}, x.options());
  const RecurrenceArgs args{dt_softplus, static_cast<float>(dt_min), static_cast<float>(dt_max)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "selective_state_update", [&] {
    ssm_update_impl<scalar_t>(out, state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, args);
  });
  return out;
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("causal_conv1d_update(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, bool silu, "
        "Tensor cache_indices) -> Tensor");
  m.def("selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
        "Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor state_batch_indices, float dt_min, float dt_max) "
        "-> Tensor");
}

PAGEDLLM_IMPL(CPU, m) {
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("selective_state_update", &selective_state_update);
}
