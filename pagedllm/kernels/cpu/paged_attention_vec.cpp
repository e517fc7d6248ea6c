// The vector decode-attention kernel (head_dim % kVecWidth == 0, head_dim <= 256; simd.h's
// VecF: 16 lanes in AVX-512 builds, 8 in AVX2 builds; absent from portable builds), written
// once: attend<Dot, T, C, G> computes the G members of a Work item together, so each K and V
// row is loaded once, in two passes in float32 over the context (from the first member's
// window start with a sliding window):
//
//   1. the scores q.k of every member into the scratch's rows (qk), soft-capped if so
//      (soft_cap), then the softmax of each member over its own positions (its window up to
//      its length), a sink logit joining the denominator, its weights elsewhere 0
//      (softmax_numerators);
//   2. the weighted sum of the value rows, 16 tokens (a tile) at a time (pv_tile), times
//      1 / sum into the output.
//
// What each ISA does its own way (the scores, the softmax) comes from
// paged_attention_avx512.h or paged_attention_avx2.h. Dot is how the products are taken:
// F32Dot (below; rows widened to float32, float32 multiply-adds) everywhere, Bf16Dot
// (paged_attention_avx512.h; vdpbf16ps) for bfloat16 queries with AVX512-BF16. The scale
// (and an FP8 cache's k_scale, and the factor its row loads leave, kLoadScale) is folded into
// the queries or the scores, v_scale into the softmax's 1 / sum, so scaling costs nothing per
// element. A member's output takes the same operations whichever run it is in (a Dot whose
// value products pair rows, Bf16Dot, reads from an even position: kRowAlign), so a token of a
// run gets the bits it gets alone.
#include "paged_attention.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#if defined(__AVX512F__)
#include "paged_attention_avx512.h"
#elif defined(PAGEDLLM_VEC)
#include "paged_attention_avx2.h"
#endif

namespace pagedllm_attention PAGEDLLM_HIDDEN {

#ifdef PAGEDLLM_VEC
namespace {
using namespace pagedllm_simd;

// A Dot gives attend, in the order it uses them: kWiden<C> (what the row loads divide the
// cache's values by), load_queries (into the scratch's q), qk (the scores of the context),
// round_weights (the softmax weights into the form pv_tile reads), pv_tile (a tile's values
// into acc) and store_output (acc times 1 / sum into the output row).
//
// A Dot also gives kRowAlign: the rows are read from a position that is a multiple of it (the
// first member's window start rounded down; zero rows stand in for those before the start).
//
// F32Dot, the float32 products: queries scaled into float32 (scale x k_scale x kLoadScale<C>),
// rows read by vload_scaled (kWiden<C> = kLoadScale<C>, restored in the softmax's 1 / sum).
struct F32Dot {
  template <typename C>
  static constexpr float kWiden = kLoadScale<C>;
  static constexpr int64_t kRowAlign = 1;

  template <typename T, typename C, int G>
  static void load_queries(const Params& p, const Ptrs<T, C>& x, const Work& wk, float* qf) {
    const VecF sc = vset1(p.scale * p.k_scale * kLoadScale<C>);
    for (int g = 0; g < G; ++g) {
      const T* q = x.q + wk.token(g) * p.q_sb + wk.head(p, g) * p.q_sh;
      for (int64_t c = 0; c < p.head_dim; c += kVecWidth) vstore(qf + g * p.head_dim + c, vload(q + c) * sc);
    }
  }

  // Scores of the next n rows of keys (lead is 0: kRowAlign 1).
  template <typename C, int G>
  static PAGEDLLM_INLINE void qk(const Params& p, const float* qf, RowCursor<C>& keys, int64_t, int64_t n,
                                 float* scores, int64_t cap) {
    qk_f32<C, G>(qf, p.head_dim, keys, n, scores, cap);
  }

  template <int G>
  static void round_weights(const float*, int64_t, int64_t, uint16_t*) {}  // the weights stay float32

  // Values of one tile: acc [G][D] += weight[g][t0 + j] * rows[j] for the first cnt rows.
  template <typename C, int G>
  static PAGEDLLM_INLINE void pv_tile(const C* const* rows, int cnt, const Scratch& w, int64_t t0, float* acc,
                                      int64_t D) {
    const float* wt = w.scores + t0;
    for (int64_t c = 0; c < D; c += kVecWidth) {
      VecF a[G];
      for (int g = 0; g < G; ++g) a[g] = vload(acc + g * D + c);
      for (int j = 0; j < cnt; ++j) {
        const VecF vv = vload_scaled(rows[j] + c);
        for (int g = 0; g < G; ++g) a[g] = vfmadd(vset1(wt[g * w.cap + j]), vv, a[g]);
      }
      for (int g = 0; g < G; ++g) vstore(acc + g * D + c, a[g]);
    }
  }

  // out[0, D) = acc * inv.
  template <typename T>
  static void store_output(T* o, const float* a, int64_t D, float inv) {
    const VecF vinv = vset1(inv);
    for (int64_t c = 0; c < D; c += kVecWidth) vstore_finite(o + c, vload(a + c) * vinv);
  }
};

// s[0, n) = cap * tanh(s / cap) in place (logits soft-capping): tanh(y) = expm1(2y) /
// (expm1(2y) + 2), with expm1 = 2^k (p(r) + 1) - 1 = 2^k p(r) + (2^k - 1) over 2y = k ln2 + r,
// |r| <= ln2 / 2, p a degree-7 Taylor polynomial (relative error ~1e-7 near 0, where 1 - 2 /
// (exp(2y) + 1) would cancel); std::tanh over the last n % kVecWidth.
inline void soft_cap(float* s, int64_t n, float cap) {
  const VecF two_over_cap = vset1(2.f / cap), vcap = vset1(cap), one = vset1(1.f), two = vset1(2.f);
  int64_t i = 0;
  for (; i + kVecWidth <= n; i += kVecWidth) {
    const VecF x = vmin(vmax(vload(s + i) * two_over_cap, vset1(-40.f)), vset1(40.f));  // tanh(20) rounds to 1
    const VecF k = vround_nearest(x * vset1(1.44269504088896341f));
    const VecF r = vfnmadd(k, vset1(-2.12194440e-4f), vfnmadd(k, vset1(0.693359375f), x));
    VecF y = vset1(1.f / 5040.f);
    for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f}) y = vfmadd(y, r, vset1(c));
    const VecF pr = vfmadd(y * r, r, r);
    const VecF two_k = vpow2_times(one, k);
    const VecF em1 = vfmadd(two_k, pr, two_k - one);
    vstore(s + i, vcap * (em1 / (em1 + two)));
  }
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

template <typename Dot, typename T, typename C, int G>
void attend(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) {
  const int64_t D = p.head_dim, cap = w.cap, n = wk.n, h = wk.h;
  float *scores = w.scores, *acc = w.acc;
  // Rows are read from `first`, the first member's window start (members are in token order),
  // after `lead` zero rows from `base`, a multiple of kRowAlign: score i is position base + i.
  const int64_t first = wk.start(p, 0), lead = first % Dot::kRowAlign, base = first - lead;

  // Pass 1: scores.
  RowCursor<C> keys(p, x.block_table, wk.table_row(), x.k + h * p.k_sh, p.k_sb, p.k_st, first, n);
  Dot::template load_queries<T, C, G>(p, x, wk, w.q);
  Dot::template qk<C, G>(p, w.q, keys, lead, n - first, scores, cap);

  // Softmax (V rows start arriving meanwhile), each member over its own positions [lo, hi);
  // its weights elsewhere are 0 up to the last tile.
  RowCursor<C> values(p, x.block_table, wk.table_row(), x.v + h * p.v_sh, p.v_sb, p.v_st, first, n);
  float inv_sum[G];
  const int64_t n_tiles = round_up(n - base, kTile);
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * cap;
    const int64_t lo = wk.start(p, g) - base, hi = wk.len(g) - base;
    if (p.soft_cap > 0.f) soft_cap(s + lo, hi - lo, p.soft_cap);
    inv_sum[g] = softmax_numerators(s + lo, hi - lo, sink_logit(p, wk.head(p, g))) * p.v_scale * Dot::template kWiden<C>;
    std::fill(s, s + lo, 0.f);
    std::fill(s + hi, s + n_tiles, 0.f);
  }
  Dot::template round_weights<G>(scores, cap, n_tiles, w.weights16);

  // Pass 2: weighted sum of the values.
  std::fill(acc, acc + G * D, 0.f);
  for_each_tile(values, lead, n - first, [&](const C* const* rows, int cnt, int64_t t0) PAGEDLLM_INLINE_LAMBDA {
    Dot::template pv_tile<C, G>(rows, cnt, w, t0, acc, D);
  });
  for (int g = 0; g < G; ++g)
    Dot::store_output(x.o + wk.token(g) * p.o_sb + wk.head(p, g) * p.o_sh, acc + g * D, D, inv_sum[g]);
}

template <typename Dot, typename T, typename C, int... G>
void set_kernels(AttendFn<T, C>* by_group, std::integer_sequence<int, G...>) {
  ((by_group[G + 1] = attend<Dot, T, C, G + 1>), ...);
}
}  // namespace
#endif  // PAGEDLLM_VEC

template <typename T, typename C>
bool vector_kernels(int64_t head_dim, AttendFn<T, C>* by_group) {
#ifdef PAGEDLLM_VEC
  if (head_dim % kVecWidth != 0 || head_dim > kMaxVecDim) return false;
  const auto groups = std::make_integer_sequence<int, kMaxGroup>();
#if defined(__AVX512BF16__)
  if constexpr (Bf16Dot::kApplies<T, C>) {
    if (head_dim % 32 == 0) {
      set_kernels<Bf16Dot, T, C>(by_group, groups);
      return true;
    }
  }
#endif
  set_kernels<F32Dot, T, C>(by_group, groups);
  return true;
#else
  (void)head_dim;
  (void)by_group;
  return false;
#endif
}

#define PAGEDLLM_INSTANTIATE(T, C) template bool vector_kernels<T, C>(int64_t, AttendFn<T, C>*);
PAGEDLLM_ATTENTION_DTYPES(PAGEDLLM_INSTANTIATE)
#undef PAGEDLLM_INSTANTIATE

}  // namespace pagedllm_attention
