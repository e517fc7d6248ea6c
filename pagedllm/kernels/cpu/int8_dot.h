// Integer dot products of int8 activations with 4- and 8-bit unsigned weights in
// linear_grouped.cpp's blocks of 16 outputs (the arithmetic of llama.cpp's Q8_0 activations).
//
// Activations: each row of x is cut into blocks of kXBlock = 32 inputs and quantized per block,
// symmetric, with a float32 scale (quantize_rows):
//
//   d = max |x_k| / 127,   a_k = round_half_even(x_k / d)  (0 when d = 0),   asum = sum a_k
//
// Weights: one block of 16 outputs x 32 inputs (unsigned Q, 0-15 or 0-255) times one row's 32
// int8 a_k gives 16 exact int32 sums  dot_j = sum_k a_k Q[j, k] - kOffset<Bits> * asum  (dot32):
//
// - AVX-512 with VNNI (the avx512_bf16 level): vpdpbusd multiplies unsigned bytes (Q) by signed
//   bytes (a) and adds each 4 products into an int32 lane, exactly;
// - AVX-512BW without VNNI and AVX2: vpmaddubsw (unsigned x signed byte pairs summed into int16,
//   saturating) + vpmaddwd by ones (int16 pairs into int32). 4-bit Q: 2 * 15 * 127 < 2^15, exact.
//   8-bit Q: 2 * 255 * 127 would saturate, so Q - 128 (Q xor 0x80) is split into its magnitude
//   (unsigned, at most 128) and its sign, moved onto a (vpsignb; AVX-512: a masked negate):
//   2 * 128 * 127 < 2^15, exact; the sum is then over a (Q - 128), kOffset<8> = 128;
// - portable: plain int32 loops.
//
// The vector paths read the blocked layout as stored (no repacking at load time): a 32-bit lane
// must hold one output's 4 consecutive inputs, while a stored 64 bytes hold 16 outputs for each
// of 4 inputs (8 bits) or of 4 input pairs (4 bits, low and high nibbles), so the bytes are
// transposed in registers (a dword permute and a byte shuffle per 64 bytes) - cheap next to the
// memory stream the decode matmul is bound by. Every path yields output j in lane j.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "weight_blocks.h"

namespace pagedllm_int8 {

using pagedllm_blocks::kBlock;

constexpr int64_t kXBlock = 32;  // inputs per activation block

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(__AVX512VNNI__)
#define PAGEDLLM_INT8_MADDUBS 1
#elif defined(PAGEDLLM_BLOCK_STREAM) && !defined(__AVX512F__)
#define PAGEDLLM_INT8_MADDUBS 1
#endif

// What dot32 subtracts per unit of asum: 128 where 8-bit weights go through vpmaddubsw as Q - 128.
template <int Bits>
constexpr int32_t kOffset =
#ifdef PAGEDLLM_INT8_MADDUBS
    Bits == 8 ? 128 : 0;
#else
    0;
#endif

// Rows [0, m) of x (float32 [m, k], k a multiple of kXBlock) -> a [m, k] int8, d and asum
// [m, k / kXBlock] (float32 scale, int32 sum of a per block), as in the header comment.
inline void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* a, float* d, int32_t* asum) {
  const int64_t blocks = k / kXBlock;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k + b * kXBlock;
      int8_t* ab = a + r * k + b * kXBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kXBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / 127.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kXBlock; ++i) {
        const float q = scale == 0.f ? 0.f : std::clamp(std::nearbyint(xb[i] / scale), -127.f, 127.f);
        ab[i] = static_cast<int8_t>(q);
        sum += ab[i];
      }
      d[r * blocks + b] = scale;
      asum[r * blocks + b] = sum;
    }
  }
}

// Bytes of a stored block per input.
template <int Bits>
constexpr int64_t bytes_per_input() {
  return Bits == 4 ? kBlock / 2 : kBlock;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__AVX512F__)
// 16 int32 lanes, output j in lane j.
struct Lanes {
  __m512i v;
};
inline Lanes lanes_zero() { return {_mm512_setzero_si512()}; }
inline void lanes_to_float(const Lanes& l, pagedllm_simd::VecF* f) { f[0] = {_mm512_cvtepi32_ps(l.v)}; }

// acc[r] += w (16 outputs x 4 inputs, unsigned bytes) . the 4 int8 of row r at a + r * lda.
template <int Bits, int R>
PAGEDLLM_INLINE void dot4(__m512i w, const int8_t* a, int64_t lda, Lanes* acc) {
#ifdef PAGEDLLM_INT8_MADDUBS
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (Bits == 8) {
    const __m512i centred = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m512i magnitude = _mm512_abs_epi8(centred);
    const __mmask64 negative = _mm512_movepi8_mask(centred);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(load_i32(a + r * lda));
      const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
      acc[r].v = _mm512_add_epi32(acc[r].v, _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_x), ones));
    }
  } else {
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_set1_epi32(load_i32(a + r * lda));
      acc[r].v = _mm512_add_epi32(acc[r].v, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
    }
  }
#else
  for (int r = 0; r < R; ++r) acc[r].v = _mm512_dpbusd_epi32(acc[r].v, w, _mm512_set1_epi32(load_i32(a + r * lda)));
#endif
}

// acc[r] += one stored block's 32 inputs (wb) . row r's 32 int8 (a + r * lda), dot_j in lane j.
template <int Bits, int R>
PAGEDLLM_INLINE void dot32(const uint8_t* wb, const int8_t* a, int64_t lda, Lanes* acc) {
  const __m512i lane_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  if constexpr (Bits == 8) {
    // 64 bytes = inputs i..i+3 (one per 128-bit lane) x 16 outputs: gather dword L of each input
    // into lane L, then transpose each lane's 4 x 4 bytes.
    const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int64_t i = 0; i < kXBlock; i += 4) {
      const __m512i raw = _mm512_loadu_si512(wb + i * kBlock);
      dot4<Bits, R>(_mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, raw), lane_bytes), a + i, lda, acc);
    }
  } else {
    // 64 bytes = input pairs p..p+3 (one per lane) x 16 outputs; nibbles interleaved into words
    // (the pair's two inputs), words of two pairs gathered per output, then joined into dwords.
    const __m512i first = _mm512_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7, 16, 17, 20, 21, 18, 19, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 12, 13, 10, 11, 14, 15, 24, 25, 28, 29, 26, 27, 30, 31);
    const __m512i words = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t i = 0; i < kXBlock; i += 8) {
      const __m512i raw = _mm512_loadu_si512(wb + (i / 2) * kBlock);
      const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      const __m512i t = _mm512_unpacklo_epi8(lo, hi), u = _mm512_unpackhi_epi8(lo, hi);
      dot4<Bits, R>(_mm512_shuffle_epi8(_mm512_permutex2var_epi32(t, first, u), words), a + i, lda, acc);
      dot4<Bits, R>(_mm512_shuffle_epi8(_mm512_permutex2var_epi32(t, second, u), words), a + i + 4, lda, acc);
    }
  }
}

#elif defined(PAGEDLLM_BLOCK_STREAM)
// 16 int32 lanes in two registers: outputs 0-7 and 8-15.
struct Lanes {
  __m256i lo, hi;
};
inline Lanes lanes_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline void lanes_to_float(const Lanes& l, pagedllm_simd::VecF* f) {
  f[0] = {_mm256_cvtepi32_ps(l.lo)};
  f[1] = {_mm256_cvtepi32_ps(l.hi)};
}

PAGEDLLM_INLINE __m256i dot_bytes(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// acc[r] += (w_lo, w_hi) (outputs 0-7, 8-15 x 4 inputs, unsigned bytes) . row r's 4 int8.
template <int Bits, int R>
PAGEDLLM_INLINE void dot4(__m256i w_lo, __m256i w_hi, const int8_t* a, int64_t lda, Lanes* acc) {
  if constexpr (Bits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i c_lo = _mm256_xor_si256(w_lo, flip), c_hi = _mm256_xor_si256(w_hi, flip);
    const __m256i m_lo = _mm256_abs_epi8(c_lo), m_hi = _mm256_abs_epi8(c_hi);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(load_i32(a + r * lda));
      acc[r].lo = _mm256_add_epi32(acc[r].lo, dot_bytes(m_lo, _mm256_sign_epi8(x, c_lo)));
      acc[r].hi = _mm256_add_epi32(acc[r].hi, dot_bytes(m_hi, _mm256_sign_epi8(x, c_hi)));
    }
  } else {
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(load_i32(a + r * lda));
      acc[r].lo = _mm256_add_epi32(acc[r].lo, dot_bytes(w_lo, x));
      acc[r].hi = _mm256_add_epi32(acc[r].hi, dot_bytes(w_hi, x));
    }
  }
}

// Each 128-bit lane of t holds words (or byte pairs) of 8 outputs for two input pairs, lane 0
// outputs 0-7 of the first, lane 1 of the second: quadwords reordered so that a lane holds 4
// outputs of both, then bytes (``order``) joined into one dword per output.
PAGEDLLM_INLINE __m256i join_dwords(__m256i t, __m256i order) {
  return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(t, 0xD8), order);
}

template <int Bits, int R>
PAGEDLLM_INLINE void dot32(const uint8_t* wb, const int8_t* a, int64_t lda, Lanes* acc) {
  if constexpr (Bits == 8) {
    // 32 bytes = inputs i, i + 1; the next 32 = i + 2, i + 3. Bytes interleave to (i, i + 2)
    // and (i + 1, i + 3) pairs, joined into (i, i + 1, i + 2, i + 3).
    const __m256i order = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
    for (int64_t i = 0; i < kXBlock; i += 4) {
      const __m256i r01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * kBlock));
      const __m256i r23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (i + 2) * kBlock));
      dot4<Bits, R>(join_dwords(_mm256_unpacklo_epi8(r01, r23), order), join_dwords(_mm256_unpackhi_epi8(r01, r23), order),
                    a + i, lda, acc);
    }
  } else {
    // 32 bytes = input pairs (i, i + 1) and (i + 2, i + 3): nibbles interleave to those pairs.
    const __m256i order = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < kXBlock; i += 4) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (i / 2) * kBlock));
      const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      dot4<Bits, R>(join_dwords(_mm256_unpacklo_epi8(lo, hi), order), join_dwords(_mm256_unpackhi_epi8(lo, hi), order),
                    a + i, lda, acc);
    }
  }
}

#else
// Portable: plain int32 loops on the stored layout.
struct Lanes {
  int32_t v[kBlock];
};
inline Lanes lanes_zero() { return Lanes{}; }

template <int Bits, int R>
inline void dot32(const uint8_t* wb, const int8_t* a, int64_t lda, Lanes* acc) {
  for (int64_t i = 0; i < kXBlock; ++i) {
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t q = Bits == 4 ? (wb[(i / 2) * kBlock + j] >> (4 * (i % 2))) & 0x0F : wb[i * kBlock + j];
      for (int r = 0; r < R; ++r) acc[r].v[j] += q * a[r * lda + i];
    }
  }
}
#endif

// 16 float32 sums (output j in lane j) and the per-block float arithmetic on dot32's lanes.
#ifdef PAGEDLLM_VEC
constexpr int kSumVecs = kBlock / pagedllm_simd::kVecWidth;
struct Sums {
  pagedllm_simd::VecF v[kSumVecs];
};
inline Sums sums_zero() {
  Sums s;
  for (int i = 0; i < kSumVecs; ++i) s.v[i] = pagedllm_simd::vset1(0.f);
  return s;
}
inline void sums_store(float* p, const Sums& s) {
  for (int i = 0; i < kSumVecs; ++i) pagedllm_simd::vstore(p + i * pagedllm_simd::kVecWidth, s.v[i]);
}
// p[j * stride] - minus in lane j for j < n_valid; later lanes repeat lane n_valid - 1 (a
// block's padding outputs, whose sums are discarded).
inline Sums sums_gather(const float* p, int64_t stride, int64_t n_valid, float minus) {
  Sums s;
#if defined(__AVX512F__)
  const __m512i j = _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(static_cast<int32_t>(n_valid - 1)));
  const __m512i index = _mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int32_t>(stride)));
  s.v[0] = {_mm512_sub_ps(_mm512_i32gather_ps(index, p, 4), _mm512_set1_ps(minus))};
#else
  const __m256i last = _mm256_set1_epi32(static_cast<int32_t>(n_valid - 1));
  const __m256i step = _mm256_set1_epi32(static_cast<int32_t>(stride));
  for (int i = 0; i < kSumVecs; ++i) {
    const __m256i j = _mm256_min_epi32(_mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * i)), last);
    s.v[i] = {_mm256_sub_ps(_mm256_i32gather_ps(p, _mm256_mullo_epi32(j, step), 4), _mm256_set1_ps(minus))};
  }
#endif
  return s;
}
// sums_gather for float16 values (minus 0): lane j holds p[j * stride] (clamped as there). p
// must be 4-byte aligned: each lane gathers the aligned 32-bit word holding its value and
// shifts it down (an aligned word never crosses a page, so the last one, which may extend two
// bytes past the array, is safe to read).
inline Sums sums_gather_half(const c10::Half* p, int64_t stride, int64_t n_valid) {
  Sums s;
#if defined(__AVX512F__)
  const __m512i j = _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(static_cast<int32_t>(n_valid - 1)));
  const __m512i e = _mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int32_t>(stride)));
  const __m512i words = _mm512_i32gather_epi32(_mm512_srli_epi32(e, 1), p, 4);
  const __m512i bits = _mm512_srlv_epi32(words, _mm512_slli_epi32(_mm512_and_si512(e, _mm512_set1_epi32(1)), 4));
  s.v[0] = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits))};
#else
  const __m256i last = _mm256_set1_epi32(static_cast<int32_t>(n_valid - 1));
  const __m256i step = _mm256_set1_epi32(static_cast<int32_t>(stride));
  // The low two bytes of each dword, packed into the low 8 bytes of each 128-bit lane.
  const __m256i low_halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int i = 0; i < kSumVecs; ++i) {
    const __m256i j = _mm256_min_epi32(_mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * i)), last);
    const __m256i e = _mm256_mullo_epi32(j, step);
    const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(p), _mm256_srli_epi32(e, 1), 4);
    const __m256i bits = _mm256_srlv_epi32(words, _mm256_slli_epi32(_mm256_and_si256(e, _mm256_set1_epi32(1)), 4));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bits, low_halves), 0x08);
    s.v[i] = {_mm256_cvtph_ps(_mm256_castsi256_si128(packed))};
  }
#endif
  return s;
}
inline Sums sums_set1(float value) {
  Sums s;
  for (int i = 0; i < kSumVecs; ++i) s.v[i] = pagedllm_simd::vset1(value);
  return s;
}
// p[j] - minus in lane j (16 consecutive float32 or float16 values).
template <typename T>
inline Sums sums_load(const T* p, float minus) {
  Sums s;
  for (int i = 0; i < kSumVecs; ++i) {
    s.v[i] = pagedllm_simd::vload(p + i * pagedllm_simd::kVecWidth) - pagedllm_simd::vset1(minus);
  }
  return s;
}
// t += d * (dot - zo * asum), in float32 (dot and zo * asum exact for |dot| < 2^24 and integral zo).
PAGEDLLM_INLINE void fold_block(Sums& t, const Lanes& dot, const Sums& zo, float d, float asum) {
  pagedllm_simd::VecF f[kSumVecs];
  lanes_to_float(dot, f);
  const pagedllm_simd::VecF dv = pagedllm_simd::vset1(d), av = pagedllm_simd::vset1(asum);
  for (int i = 0; i < kSumVecs; ++i) t.v[i] = pagedllm_simd::vfmadd(dv, pagedllm_simd::vfnmadd(zo.v[i], av, f[i]), t.v[i]);
}
// out += s * t.
PAGEDLLM_INLINE void fold_group(Sums& out, const Sums& s, const Sums& t) {
  for (int i = 0; i < kSumVecs; ++i) out.v[i] = pagedllm_simd::vfmadd(s.v[i], t.v[i], out.v[i]);
}
#else
struct Sums {
  float v[kBlock];
};
inline Sums sums_zero() { return Sums{}; }
inline void sums_store(float* p, const Sums& s) { std::memcpy(p, s.v, sizeof(s.v)); }
inline Sums sums_gather(const float* p, int64_t stride, int64_t n_valid, float minus) {
  Sums s;
  for (int64_t j = 0; j < kBlock; ++j) s.v[j] = p[std::min(j, n_valid - 1) * stride] - minus;
  return s;
}
inline Sums sums_gather_half(const c10::Half* p, int64_t stride, int64_t n_valid) {
  Sums s;
  for (int64_t j = 0; j < kBlock; ++j) s.v[j] = static_cast<float>(p[std::min(j, n_valid - 1) * stride]);
  return s;
}
inline Sums sums_set1(float value) {
  Sums s;
  for (int64_t j = 0; j < kBlock; ++j) s.v[j] = value;
  return s;
}
template <typename T>
inline Sums sums_load(const T* p, float minus) {
  Sums s;
  for (int64_t j = 0; j < kBlock; ++j) s.v[j] = static_cast<float>(p[j]) - minus;
  return s;
}
inline void fold_block(Sums& t, const Lanes& dot, const Sums& zo, float d, float asum) {
  for (int64_t j = 0; j < kBlock; ++j) t.v[j] = std::fma(d, std::fma(-zo.v[j], asum, static_cast<float>(dot.v[j])), t.v[j]);
}
inline void fold_group(Sums& out, const Sums& s, const Sums& t) {
  for (int64_t j = 0; j < kBlock; ++j) out.v[j] = std::fma(s.v[j], t.v[j], out.v[j]);
}
#endif

}  // namespace pagedllm_int8
