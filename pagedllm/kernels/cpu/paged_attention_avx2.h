// The steps of the decode-attention vector kernel (paged_attention_vec.cpp) that AVX2 builds
// do their own way, on simd.h's 8-lane VecF; included by that file only.
//
//   scores (qk_f32): one key row at a time, widened once and multiplied into the G
//     members' accumulators, each then summed across its lanes;
//   softmax (softmax_numerators): Cephes' exp (vexp) over whole vectors, std::exp over the
//     last n % 8 scores (and a sink logit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "paged_attention.h"
#include "simd.h"

namespace pagedllm_attention PAGEDLLM_HIDDEN {
using namespace pagedllm_simd;

// Scores of the next n rows of keys for G members: scores[g * cap + t] = qf[g] . row t, qf
// [G][D] the scaled queries.
template <typename C, int G>
PAGEDLLM_INLINE void qk_f32(const float* qf, int64_t D, RowCursor<C>& keys, int64_t n, float* scores, int64_t cap) {
  for (int64_t t = 0; t < n; ++t) {
    const C* k = keys.next();
    VecF a[G];
    for (int g = 0; g < G; ++g) a[g] = vset1(0.f);
    for (int64_t c = 0; c < D; c += kVecWidth) {
      const VecF kv = vload_scaled(k + c);
      for (int g = 0; g < G; ++g) a[g] = vfmadd(vload(qf + g * D + c), kv, a[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * cap + t] = vreduce_add(a[g]);
  }
}

// Softmax numerators of s[0, n) in place, with a sink logit (-inf: none) in the maximum and
// the sum. Returns 1 / sum.
inline float softmax_numerators(float* s, int64_t n, float sink) {
  float mx = sink;
  int64_t i = 0;
  if (n >= kVecWidth) {
    VecF mv = vset1(mx);
    for (; i + kVecWidth <= n; i += kVecWidth) mv = vmax(mv, vload(s + i));
    mx = vreduce_max(mv);
  }
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  const VecF vmx = vset1(mx);
  VecF sv = vset1(0.f);
  float sum = 0.f;
  for (i = 0; i + kVecWidth <= n; i += kVecWidth) {
    const VecF e = vexp(vload(s + i) - vmx);
    vstore(s + i, e);
    sv = sv + e;
  }
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return 1.f / (vreduce_add(sv) + sum + std::exp(sink - mx));
}

}  // namespace pagedllm_attention
