// The portable decode-attention kernel: plain loops, for any head_dim and in every build (the
// _portable operator runs them whatever the build). Single query tokens: runs of tokens are
// formed for the vector kernel only. Scores q.k of the context (its last window tokens with a
// sliding window) first, soft-capped if so, then the softmax (std::exp; a sink logit joins
// the denominator), then the weighted sum of the value rows, each row widened once into w.row.
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace pagedllm_attention PAGEDLLM_HIDDEN {

template <typename T, typename C>
void attend_portable(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) {
  const int64_t G = wk.count, D = p.head_dim, cap = w.cap, n = wk.n, b = wk.b, h = wk.h;
  const int64_t first = wk.start(p, 0), m = n - first;  // the m positions first .. n - 1
  float *scores = w.scores, *acc = w.acc, *qf = w.q, *row = w.row, *inv_sum = w.inv_sum;
  for (int64_t g = 0; g < G; ++g) {
    const T* q = x.q + b * p.q_sb + (h * p.group + wk.g0 + g) * p.q_sh;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[d]) * (p.scale * p.k_scale);
  }
  RowCursor<C> keys(p, x.block_table, b, x.k + h * p.k_sh, p.k_sb, p.k_st, first, n);
  for (int64_t t = 0; t < m; ++t) {
    const C* k = keys.next();
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
      scores[g * cap + t] = s;
    }
  }
  RowCursor<C> values(p, x.block_table, b, x.v + h * p.v_sh, p.v_sb, p.v_st, first, n);
  for (int64_t g = 0; g < G; ++g) {  // softmax, unnormalised; divided by the sum at the end
    float* s = scores + g * cap;
    if (p.soft_cap > 0.f) {
      for (int64_t t = 0; t < m; ++t) s[t] = p.soft_cap * std::tanh(s[t] / p.soft_cap);
    }
    const float sink = sink_logit(p, h * p.group + wk.g0 + g);
    float mx = sink;
    for (int64_t t = 0; t < m; ++t) mx = std::max(mx, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < m; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    inv_sum[g] = p.v_scale / (sum + std::exp(sink - mx));
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < m; ++t) {
    const C* v = values.next();
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float wt = scores[g * cap + t];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += wt * row[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    T* o = x.o + b * p.o_sb + (h * p.group + wk.g0 + g) * p.o_sh;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
  }
}

#define PAGEDLLM_INSTANTIATE(T, C) \
  template void attend_portable<T, C>(const Params&, const Ptrs<T, C>&, const Work&, const Scratch&);
PAGEDLLM_ATTENTION_DTYPES(PAGEDLLM_INSTANTIATE)
#undef PAGEDLLM_INSTANTIATE

}  // namespace pagedllm_attention
