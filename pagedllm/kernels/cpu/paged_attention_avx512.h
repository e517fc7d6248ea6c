// The steps of the decode-attention vector kernel (paged_attention_vec.cpp) that AVX-512 builds
// do their own way, on simd.h's 16-lane VecF and AVX-512 shuffles; included by that file only.
//
//   scores (qk_f32, qk_tile_f32): the tile's 16 K rows are transposed in registers so that one vector
//     holds one element of 16 tokens; q . k is then a broadcast multiply-add per element, with
//     no horizontal sums (the rows past the context are kZeroRow);
//   softmax (softmax_numerators): masked vectors over the whole row, exp by a Taylor polynomial
//     (std::exp for a sink logit).
//
// With AVX512-BF16, bfloat16 queries (Bf16Dot, head_dim % 32 == 0):
//   scores: pairs of elements go through vdpbf16ps (bf16 products are exact in float32);
//   values: the weights are rounded to bfloat16 and two tokens' rows are interleaved for
//     vdpbf16ps (accumulation stays float32; this is what bf16 attention kernels do);
//   FP8 caches: rows are widened to bfloat16 in registers, 32 elements at a time, as they are
//     loaded into the same vdpbf16ps steps (the keys, with head_dim % 64 == 0, transposed as
//     bytes before widening: qk_tile_fp8; load32_bf16: shifts and an add rebias the exponent;
//     zero and subnormals come from a 32-entry vpermw table).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "paged_attention.h"
#include "simd.h"

namespace pagedllm_attention PAGEDLLM_HIDDEN {
using namespace pagedllm_simd;

// exp(x) for x <= 0 (arguments are score - max): Cody-Waite reduction, degree-7 Taylor
// polynomial on |r| <= ln2/2 (relative error ~1e-7), scaled by 2^n with scalef.
inline VecF exp_nonpositive(VecF x) {
  x = vmax(x, vset1(-104.f));  // exp(-104) underflows to 0 via scalef
  const VecF n = vround_nearest(x * vset1(1.44269504088896341f));
  const VecF r = vfnmadd(n, vset1(-2.12194440e-4f), vfnmadd(n, vset1(0.693359375f), x));
  VecF y = vset1(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) y = vfmadd(y, r, vset1(c));
  return vpow2_times(y, n);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// Softmax numerators of s[0, n) in place, with a sink logit (-inf: none) in the maximum and
// the sum; s[n, round_up(n, 16)) set to 0. Returns 1 / sum.
inline float softmax_numerators(float* s, int64_t n, float sink) {
  VecF mv = vset1(sink);
  for (int64_t i = 0; i < n; i += 16) mv = vmax(mv, {_mm512_mask_loadu_ps(mv.v, tail_mask(n - i), s + i)});
  const float m_max = vreduce_max(mv);
  const VecF mx = vset1(m_max);
  VecF sv = vset1(0.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const VecF e = {_mm512_maskz_mov_ps(m, exp_nonpositive(VecF{_mm512_maskz_loadu_ps(m, s + i)} - mx).v)};
    vstore(s + i, e);
    sv = sv + e;
  }
  return 1.f / (vreduce_add(sv) + std::exp(sink - m_max));
}

// In-place transpose of a 16 x 16 matrix of 32-bit elements: r[i] lane j -> r[j] lane i.
PAGEDLLM_INLINE void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 32-bit interleave of row pairs
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4R + p], 128-bit lane l = rows 4R..4R+3, element 4l + p
  __m512i u[16];
  for (int R = 0; R < 4; ++R) {
    const __m512i* tt = t + 4 * R;
    u[4 * R + 0] = _mm512_unpacklo_epi64(tt[0], tt[2]);
    u[4 * R + 1] = _mm512_unpackhi_epi64(tt[0], tt[2]);
    u[4 * R + 2] = _mm512_unpacklo_epi64(tt[1], tt[3]);
    u[4 * R + 3] = _mm512_unpackhi_epi64(tt[1], tt[3]);
  }
  for (int q = 0; q < 4; ++q) {
    // v0 = lanes [R0.l0, R0.l1, R1.l0, R1.l1], v1 = [R0.l2, R0.l3, R1.l2, R1.l3]; w0/w1 for R2, R3
    const __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(3, 2, 3, 2));
    r[0 + q] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + q] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + q] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + q] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Scores of one tile (all 16 rows; those past the context read as zeros) for G members,
// float32 products: qf [G][D] the scaled queries.
template <typename C, int G>
PAGEDLLM_INLINE void qk_tile_f32(const float* qf, int64_t D, const C* const* rows, float* scores, int64_t cap) {
  VecF acc[G];
  for (int g = 0; g < G; ++g) acc[g] = vset1(0.f);
  for (int64_t c = 0; c < D; c += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(vload_scaled(rows[j] + c).v);
    transpose16x16(r);  // r[e] = element c + e of the 16 tokens
    for (int e = 0; e < 16; ++e) {
      const VecF kv = {_mm512_castsi512_ps(r[e])};
      for (int g = 0; g < G; ++g) acc[g] = vfmadd(vset1(qf[g * D + c + e]), kv, acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) vstore(scores + g * cap, acc[g]);
}

// Scores of the next n rows of keys for G members, a tile at a time (qk_tile_f32).
template <typename C, int G>
PAGEDLLM_INLINE void qk_f32(const float* qf, int64_t D, RowCursor<C>& keys, int64_t n, float* scores, int64_t cap) {
  for_each_tile(keys, 0, n, [&](const C* const* rows, int, int64_t t0) PAGEDLLM_INLINE_LAMBDA {
    qk_tile_f32<C, G>(qf, D, rows, scores + t0, cap);
  });
}

#if defined(__AVX512BF16__)
template <typename C>
constexpr bool kIsFp8 = std::is_same<C, c10::Float8_e4m3fn>::value || std::is_same<C, c10::Float8_e5m2>::value;

// 32 elements as bfloat16 bits: bfloat16 rows as they are; FP8 rows widened exactly. A byte
// s|e|m (E exponent bits, bias B, M = 7 - E mantissa bits) is sign-extended to 16 bits;
// shifting it left by 7 - M puts the sign at bit 15 and e|m at bfloat16's exponent and
// mantissa positions, the mask drops the sign copies between, and adding (127 - B) << 7
// rebiases the exponent: exact for every e >= 1. The e = 0 bytes (zero and subnormals) take
// their magnitude from a 32-entry table indexed by the byte's low 5 bits (vpermw), then the
// sign. NaN and e5m2's infinities read as large finite values, as in simd.h (the cache writer
// saturates, so only NaN keys or values could make them).
PAGEDLLM_INLINE __m512i load32_bf16(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }

// bfloat16 bits of the e = 0 magnitudes: e4m3 m x 2^-9 (m = 0..7), e5m2 m x 2^-16 (m = 0..3).
alignas(64) constexpr uint16_t kE4m3Subnormals[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
alignas(64) constexpr uint16_t kE5m2Subnormals[32] = {0, 0x3780, 0x3800, 0x3840};

template <int kExpBits, int kBias>
PAGEDLLM_INLINE __m512i fp8_to_bf16(__m256i bytes, const uint16_t* subnormals) {
  constexpr int kMantBits = 7 - kExpBits, kShift = 7 - kMantBits;
  const __m512i table = _mm512_load_si512(subnormals);
  const __m512i x = _mm512_cvtepi8_epi16(bytes);
  const __m512i normal =
      _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, kShift), _mm512_set1_epi16(static_cast<int16_t>(0x8000 | (0x7f << kShift)))),
                       _mm512_set1_epi16((127 - kBias) << 7));
  const __mmask32 zero_exp = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x7f & ~((1 << kMantBits) - 1)));
  const __m512i magnitude = _mm512_mask_permutexvar_epi16(normal, zero_exp, x, table);
  return _mm512_ternarylogic_epi32(magnitude, x, _mm512_set1_epi16(-0x8000), 0xF8);  // magnitude | (x & bit 15)
}
PAGEDLLM_INLINE __m512i widen32_bf16(__m256i bytes, c10::Float8_e4m3fn) { return fp8_to_bf16<4, 7>(bytes, kE4m3Subnormals); }
PAGEDLLM_INLINE __m512i widen32_bf16(__m256i bytes, c10::Float8_e5m2) { return fp8_to_bf16<5, 15>(bytes, kE5m2Subnormals); }
template <typename C, typename = std::enable_if_t<kIsFp8<C>>>
PAGEDLLM_INLINE __m512i load32_bf16(const C* p) {
  return widen32_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), C());
}

// Scores of one tile, bfloat16 pairs through vdpbf16ps: qp [G][D] bf16 queries (unscaled);
// rows bfloat16 or FP8 (R).
template <typename R, int G>
PAGEDLLM_INLINE void qk_tile_bf16(const uint16_t* qp, int64_t D, const R* const* rows, float scale, float* scores,
                                  int64_t cap) {
  VecF acc[G];
  for (int g = 0; g < G; ++g) acc[g] = vset1(0.f);
  for (int64_t c = 0; c < D; c += 32) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = load32_bf16(rows[j] + c);
    transpose16x16(r);  // r[e] = elements c + 2e, c + 2e + 1 of the 16 tokens
    for (int e = 0; e < 16; ++e) {
      for (int g = 0; g < G; ++g) {
        int32_t pair;
        std::memcpy(&pair, qp + g * D + c + 2 * e, sizeof(pair));
        acc[g].v = _mm512_dpbf16_ps(acc[g].v, (__m512bh)r[e], (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  }
  const VecF sc = vset1(scale);
  for (int g = 0; g < G; ++g) vstore(scores + g * cap, acc[g] * sc);
}

// Scores of one tile from FP8 keys, head_dim % 64 == 0: the rows' bytes are transposed first
// (one 16 x 16 transpose of 4-byte groups per 64 elements, half the shuffles of the bfloat16
// rows' transposes), so r[e] holds elements c + 4e .. c + 4e + 3 of the 16 tokens; its low and
// high halves (tokens 0-7, 8-15) widen to pairs (4e, 4e + 1), (4e + 2, 4e + 3) in adjacent
// 32-bit lanes, and vdpbf16ps against the query's 4 elements repeated leaves token t's sum
// split over lanes 2t and 2t + 1, added at the end. qp [G][D] bf16 queries (unscaled).
template <typename C, int G>
PAGEDLLM_INLINE void qk_tile_fp8(const uint16_t* qp, int64_t D, const C* const* rows, float scale, float* scores,
                                 int64_t cap) {
  __m512 lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 64) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j] + c);
    transpose16x16(r);
    for (int e = 0; e < 16; ++e) {
      const __m512bh a = (__m512bh)widen32_bf16(_mm512_castsi512_si256(r[e]), C());
      const __m512bh b = (__m512bh)widen32_bf16(_mm512_extracti64x4_epi64(r[e], 1), C());
      for (int g = 0; g < G; ++g) {
        int64_t quad;
        std::memcpy(&quad, qp + g * D + c + 4 * e, sizeof(quad));
        const __m512bh qv = (__m512bh)_mm512_set1_epi64(quad);
        lo[g] = _mm512_dpbf16_ps(lo[g], a, qv);
        hi[g] = _mm512_dpbf16_ps(hi[g], b, qv);
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const VecF sc = vset1(scale);
  for (int g = 0; g < G; ++g) {
    const VecF sum = VecF{_mm512_permutex2var_ps(lo[g], even, hi[g])} + VecF{_mm512_permutex2var_ps(lo[g], odd, hi[g])};
    vstore(scores + g * cap, sum * sc);
  }
}

// The kernel's products in bfloat16 through vdpbf16ps (see the top of this file), for bfloat16
// queries over a bfloat16 or FP8 cache (FP8 rows widened to bfloat16) with head_dim % 32 == 0:
// paged_attention_vec.cpp's F32Dot steps, done with bfloat16 operands. Queries are copied as
// bfloat16 bits, unscaled (the scale multiplies the tile's scores); rows load at their value.
struct Bf16Dot {
  template <typename T, typename C>
  static constexpr bool kApplies = std::is_same<T, c10::BFloat16>::value && (std::is_same<C, T>::value || kIsFp8<C>);
  template <typename C>
  static constexpr float kWiden = 1.f;
  // pv_tile pairs rows (2j, 2j + 1) of a tile: from an even position, a token's pairs are the
  // same alone and in a run whatever its window start.
  static constexpr int64_t kRowAlign = 2;

  template <typename T, typename C, int G>
  static void load_queries(const Params& p, const Ptrs<T, C>& x, const Work& wk, float* q) {
    uint16_t* qp = reinterpret_cast<uint16_t*>(q);
    for (int g = 0; g < G; ++g)
      std::memcpy(qp + g * p.head_dim, x.q + wk.token(g) * p.q_sb + wk.head(p, g) * p.q_sh, p.head_dim * sizeof(T));
  }

  // Scores of `lead` zero rows then the next n rows of keys.
  template <typename C, int G>
  static PAGEDLLM_INLINE void qk(const Params& p, const float* q, RowCursor<C>& keys, int64_t lead, int64_t n,
                                 float* scores, int64_t cap) {
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(q);
    const float scale = p.scale * p.k_scale;
    for_each_tile(keys, lead, n, [&](const C* const* rows, int, int64_t t0) PAGEDLLM_INLINE_LAMBDA {
      if constexpr (kIsFp8<C>) {
        if (p.head_dim % 64 == 0) {
          qk_tile_fp8<C, G>(qp, p.head_dim, rows, scale, scores + t0, cap);
          return;
        }
      }
      qk_tile_bf16<C, G>(qp, p.head_dim, rows, scale, scores + t0, cap);
    });
  }

  // The weights [G][n_tiles) rounded to bfloat16 (nearest even) into weights16.
  template <int G>
  static void round_weights(const float* scores, int64_t cap, int64_t n_tiles, uint16_t* weights16) {
    for (int g = 0; g < G; ++g) {
      for (int64_t i = 0; i < n_tiles; i += 16)
        vstore_finite(reinterpret_cast<c10::BFloat16*>(weights16 + g * cap + i), vload(scores + g * cap + i));
    }
  }

  // Values of one tile, bfloat16 through vdpbf16ps: token pairs (2j, 2j+1) are interleaved
  // element-wise; the weights16 [G][cap] (pairs read as 32 bits). acc holds, per 32 elements
  // c..c+31, two vectors "lo" and "hi" in the order of unpacklo/hi_epi16 (undone by
  // store_output). Rows bfloat16 or FP8.
  template <typename C, int G>
  static PAGEDLLM_INLINE void pv_tile(const C* const* rows, int cnt, const Scratch& w, int64_t t0, float* acc,
                                      int64_t D) {
    const uint16_t* wp = w.weights16 + t0;
    const int pairs = (cnt + 1) / 2;
    for (int64_t c = 0; c < D; c += 32) {
      __m512 lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        lo[g] = _mm512_load_ps(acc + g * D + c);
        hi[g] = _mm512_load_ps(acc + g * D + c + 16);
      }
      for (int j = 0; j < pairs; ++j) {
        const __m512i a = load32_bf16(rows[2 * j] + c);
        const __m512i b = load32_bf16(rows[2 * j + 1] + c);
        const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh u = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; ++g) {
          int32_t pair;
          std::memcpy(&pair, wp + g * w.cap + 2 * j, sizeof(pair));
          const __m512bh wv = (__m512bh)_mm512_set1_epi32(pair);
          lo[g] = _mm512_dpbf16_ps(lo[g], l, wv);
          hi[g] = _mm512_dpbf16_ps(hi[g], u, wv);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm512_store_ps(acc + g * D + c, lo[g]);
        _mm512_store_ps(acc + g * D + c + 16, hi[g]);
      }
    }
  }

  // out[0, D) = acc * inv, acc in pv_tile's order.
  template <typename T>
  static void store_output(T* o, const float* a, int64_t D, float inv) {
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const VecF vinv = vset1(inv);
    for (int64_t c = 0; c < D; c += 32) {
      const __m512 lo = _mm512_load_ps(a + c), hi = _mm512_load_ps(a + c + 16);
      vstore_finite(o + c, VecF{_mm512_permutex2var_ps(lo, idx0, hi)} * vinv);
      vstore_finite(o + c + 16, VecF{_mm512_permutex2var_ps(lo, idx1, hi)} * vinv);
    }
  }
};
#endif  // __AVX512BF16__

}  // namespace pagedllm_attention
