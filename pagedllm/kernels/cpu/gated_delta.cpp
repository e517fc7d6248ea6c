// The gated delta rule (Qwen3-Next's linear attention) for CPU: the decode step and the prefill
// recurrence over a varlen batch, each (request, value head) one pass per token over its state.
//
// Registered as torch.ops.pagedllm_cpu_<level>.* (see ops.py); the PyTorch ops of
// pagedllm/model_executor/layers/mamba/ops/gated_delta.py are the reference, and their
// docstrings the contract:
//
//   gated_delta_rule_decode   q, k [B, H, K], v [B, HV, V] (one dtype), g, beta [B, HV] float32,
//                             state [slots, HV, K, V] (float32 or v's dtype), indices [B]
//                             -> out [B, HV, V] in v's dtype
//   gated_delta_rule_prefill  q, k [T, H, K], v [T, HV, V], g, beta [T, HV] as above, state,
//                             query_start_loc [R + 1], indices [R], has_initial_state bool [R]
//                             -> out [T, HV, V]; each request's final state written to its slot
//
// Per token, for value head h (q/k head h / (HV / H)), with q and k L2-normed when asked and q
// times ``scale``:  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q.  Two passes over
// the state S [K, V] per token: the first reads S^T k (the decay applied to the sum, not to S),
// the second writes exp(g) S + k delta^T and sums o from the rows it writes. Sums in float32;
// a state of v's dtype is widened to a float32 copy per (request, head) and rounded back once,
// after the request's last token (as the PyTorch ops round it). Prefill runs the recurrence
// token by token (no chunked UT transform): per token it is two passes over a state that stays
// in L2, which on CPU is as fast as the chunked form's GEMMs for the head sizes of the models.
// Work is split over ATen's pool by (request, head), a grain of about 32k state elements. Rows
// run 16 (AVX-512) or 8 (AVX2) lanes at a time (simd.h); tails and portable builds use scalar loops.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kGrainElements = 32768;
constexpr float kL2NormEps = 1e-6f;  // fla's and transformers' epsilon of the q/k L2 norm

// acc[0:n] += a * row[0:n]
inline void axpy(float* acc, const float* row, float a, int64_t n) {
  int64_t j = 0;
#ifdef PAGEDLLM_VEC
  using namespace pagedllm_simd;
  const VecF va = vset1(a);
  for (; j + kVecWidth <= n; j += kVecWidth) vstore(acc + j, vfmadd(vload(row + j), va, vload(acc + j)));
#endif
  for (; j < n; ++j) acc[j] += a * row[j];
}

// row = decay * row + kv * delta; acc += qv * row (both over n).
inline void update_row(float* row, const float* delta, float* acc, float decay, float kv, float qv, int64_t n) {
  int64_t j = 0;
#ifdef PAGEDLLM_VEC
  using namespace pagedllm_simd;
  const VecF vdecay = vset1(decay), vk = vset1(kv), vq = vset1(qv);
  for (; j + kVecWidth <= n; j += kVecWidth) {
    const VecF s = vfmadd(vload(row + j), vdecay, vload(delta + j) * vk);
    vstore(row + j, s);
    vstore(acc + j, vfmadd(s, vq, vload(acc + j)));
  }
#endif
  for (; j < n; ++j) {
    row[j] = row[j] * decay + kv * delta[j];
    acc[j] += qv * row[j];
  }
}

// dst[0:n] = src[0:n] in float32, times scale / sqrt(sum src^2 + eps) when l2norm, else scale.
template <typename T>
inline void widen_normed(float* dst, const T* src, int64_t n, bool l2norm, float scale) {
  float sq = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
    sq += dst[i] * dst[i];
  }
  const float factor = l2norm ? scale / std::sqrt(sq + kL2NormEps) : scale;
  for (int64_t i = 0; i < n; ++i) dst[i] *= factor;
}

// Strides of a [tokens, heads, dim] input whose last dimension is contiguous.
struct Strided {
  int64_t token, head;
};

template <typename T>
struct Inputs {
  const T *q, *k, *v;
  Strided qs, ks, vs;
  const float *g, *beta;  // [tokens, HV] contiguous
  int64_t hv, group, kdim, vdim;
  float scale;
  bool l2norm;
};

// Tokens [begin, end) of one request through value head h, on its float32 state s [K, V];
// outputs at out + t * HV * V + h * V. scratch: 2 K + 2 V floats.
template <typename T>
void run_tokens(const Inputs<T>& in, int64_t h, int64_t begin, int64_t end, float* s, float* scratch, T* out) {
  const int64_t K = in.kdim, V = in.vdim, kh = h / in.group;
  float *qn = scratch, *kn = scratch + K, *delta = scratch + 2 * K, *acc = delta + V;
  for (int64_t t = begin; t < end; ++t) {
    widen_normed(qn, in.q + t * in.qs.token + kh * in.qs.head, K, in.l2norm, in.scale);
    widen_normed(kn, in.k + t * in.ks.token + kh * in.ks.head, K, in.l2norm, 1.f);
    const float decay = std::exp(in.g[t * in.hv + h]), beta = in.beta[t * in.hv + h];
    std::fill(acc, acc + V, 0.f);
    for (int64_t i = 0; i < K; ++i) axpy(acc, s + i * V, kn[i], V);  // S^T k, before the decay
    const T* vr = in.v + t * in.vs.token + h * in.vs.head;
    for (int64_t j = 0; j < V; ++j) delta[j] = beta * (static_cast<float>(vr[j]) - decay * acc[j]);
    std::fill(acc, acc + V, 0.f);
    for (int64_t i = 0; i < K; ++i) update_row(s + i * V, delta, acc, decay, kn[i], qn[i], V);
    T* o = out + t * in.hv * V + h * V;
    for (int64_t j = 0; j < V; ++j) o[j] = static_cast<T>(acc[j]);
  }
}

int64_t index_at(const at::Tensor& indices, int64_t i) {
  return indices.scalar_type() == at::kInt ? indices.const_data_ptr<int32_t>()[i] : indices.const_data_ptr<int64_t>()[i];
}

// One (request, head) item of the work: tokens [begin, end) from slot's state (zeros when
// !initial), the final state written back.
struct Item {
  int64_t begin, end, slot;
  bool initial;
};

template <typename T, typename S>
void run_items(const Inputs<T>& in, at::Tensor& state, const std::vector<Item>& items, T* out) {
  const int64_t HV = in.hv, K = in.kdim, V = in.vdim;
  const int64_t ss0 = state.stride(0), ss1 = state.stride(1);
  S* sp = state.mutable_data_ptr<S>();
  const int64_t num = static_cast<int64_t>(items.size()) * HV;
  int64_t per_item = 0;  // tokens per item (mean), for the grain
  for (const Item& item : items) per_item += item.end - item.begin;
  per_item = std::max<int64_t>(1, per_item / std::max<int64_t>(1, static_cast<int64_t>(items.size())));
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, K * V * per_item));
  at::parallel_for(0, num, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(2 * K + 2 * V + (std::is_same<S, float>::value ? 0 : K * V));
    float* widened = scratch.data() + 2 * K + 2 * V;
    for (int64_t r = first; r < last; ++r) {
      const Item& item = items[r / HV];
      const int64_t h = r % HV;
      S* slot_state = sp + item.slot * ss0 + h * ss1;
      float* s;
      if constexpr (std::is_same<S, float>::value) {
        s = slot_state;
        if (!item.initial) std::fill(s, s + K * V, 0.f);
      } else {
        s = widened;
        for (int64_t i = 0; i < K * V; ++i) s[i] = item.initial ? static_cast<float>(slot_state[i]) : 0.f;
      }
      run_tokens(in, h, item.begin, item.end, s, scratch.data(), out);
      if constexpr (!std::is_same<S, float>::value) {
        for (int64_t i = 0; i < K * V; ++i) slot_state[i] = static_cast<S>(s[i]);
      }
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& state, const char* name) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0), name,
              ": q and k must be [tokens, num_k_heads, head_k_dim] and v [tokens, num_v_heads, head_v_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, name,
              ": q, k and v must be contiguous in their last dimension");
  const int64_t heads = q.size(1), hv = v.size(1);
  TORCH_CHECK(hv % heads == 0, name, ": num_v_heads must be a multiple of num_k_heads");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), name,
              ": q, k and v must have one dtype");
  for (const at::Tensor* t : {&g, &beta}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == hv && t->is_contiguous() &&
                    t->scalar_type() == at::kFloat,
                name, ": g and beta must be contiguous float32 [tokens, num_v_heads]");
  }
  TORCH_CHECK(state.dim() == 4 && state.size(1) == hv && state.size(2) == q.size(2) && state.size(3) == v.size(2) &&
                  state.stride(3) == 1 && state.stride(2) == v.size(2),
              name, ": state must be [slots, num_v_heads, head_k_dim, head_v_dim], its last two dimensions contiguous");
  TORCH_CHECK(state.scalar_type() == at::kFloat || state.scalar_type() == v.scalar_type(), name,
              ": state must be float32 or of v's dtype");
}

void check_index_tensor(const at::Tensor& t, int64_t n, const char* name, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous() &&
                  (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
              name, ": ", what, " must be contiguous int32 or int64 [", n, "]");
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, at::Tensor& state, const std::vector<Item>& items, double scale, bool l2norm) {
  at::Tensor out = at::empty({v.size(0), v.size(1), v.size(2)}, v.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "gated_delta_rule", [&] {
    const Inputs<scalar_t> in{q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                              {q.stride(0), q.stride(1)}, {k.stride(0), k.stride(1)}, {v.stride(0), v.stride(1)},
                              g.const_data_ptr<float>(), beta.const_data_ptr<float>(), v.size(1), v.size(1) / q.size(1),
                              q.size(2), v.size(2), static_cast<float>(scale), l2norm};
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (state.scalar_type() == at::kFloat) {
      run_items<scalar_t, float>(in, state, items, op);
    } else {
      run_items<scalar_t, scalar_t>(in, state, items, op);
    }
  });
  return out;
}

int64_t checked_slot(const at::Tensor& indices, int64_t i, int64_t num_slots, const char* name) {
  const int64_t slot = index_at(indices, i);
  TORCH_CHECK(slot >= 0 && slot < num_slots, name, ": slot index ", slot, " out of range [0, ", num_slots, ")");
  return slot;
}

at::Tensor gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, at::Tensor& state, const at::Tensor& cache_indices,
                                   double scale, bool use_qk_l2norm) {
  const char* name = "gated_delta_rule_decode";
  check_inputs(q, k, v, g, beta, state, name);
  const int64_t batch = q.size(0);
  check_index_tensor(cache_indices, batch, name, "cache_indices");
  std::vector<Item> items(batch);
  for (int64_t b = 0; b < batch; ++b) items[b] = {b, b + 1, checked_slot(cache_indices, b, state.size(0), name), true};
  return run(q, k, v, g, beta, state, items, scale, use_qk_l2norm);
}

at::Tensor gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, at::Tensor& state, const at::Tensor& query_start_loc,
                                    const at::Tensor& cache_indices, const at::Tensor& has_initial_state, double scale,
                                    bool use_qk_l2norm) {
  const char* name = "gated_delta_rule_prefill";
  check_inputs(q, k, v, g, beta, state, name);
  const int64_t reqs = cache_indices.size(0);
  check_index_tensor(cache_indices, reqs, name, "cache_indices");
  check_index_tensor(query_start_loc, reqs + 1, name, "query_start_loc");
  TORCH_CHECK(has_initial_state.dim() == 1 && has_initial_state.size(0) == reqs && has_initial_state.is_contiguous() &&
                  has_initial_state.scalar_type() == at::kBool,
              name, ": has_initial_state must be contiguous bool [", reqs, "]");
  const bool* initial = has_initial_state.const_data_ptr<bool>();
  std::vector<Item> items;
  items.reserve(reqs);
  int64_t previous = index_at(query_start_loc, 0);
  TORCH_CHECK(previous == 0, name, ": query_start_loc must start at 0");
  for (int64_t r = 0; r < reqs; ++r) {
    const int64_t end = index_at(query_start_loc, r + 1);
    TORCH_CHECK(end >= previous && end <= q.size(0), name, ": query_start_loc must be non-decreasing within [0, ",
                q.size(0), "]");
    const int64_t slot = checked_slot(cache_indices, r, state.size(0), name);
    if (end > previous) items.push_back({previous, end, slot, initial[r]});
    previous = end;
  }
  TORCH_CHECK(previous == q.size(0), name, ": query_start_loc must end at num_tokens ", q.size(0));
  return run(q, k, v, g, beta, state, items, scale, use_qk_l2norm);
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("gated_delta_rule_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
        "Tensor cache_indices, float scale, bool use_qk_l2norm) -> Tensor");
  m.def("gated_delta_rule_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
        "Tensor query_start_loc, Tensor cache_indices, Tensor has_initial_state, float scale, bool use_qk_l2norm) "
        "-> Tensor");
}

PAGEDLLM_IMPL(CPU, m) {
  m.impl("gated_delta_rule_decode", &gated_delta_rule_decode);
  m.impl("gated_delta_rule_prefill", &gated_delta_rule_prefill);
}
