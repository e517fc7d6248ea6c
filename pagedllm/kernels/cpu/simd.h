// One float32 vector type for the kernels that are written once for every vector ISA.
//
// VecF holds kVecWidth float32 lanes: 16 (one __m512) in AVX-512 builds, 8 (one __m256) in
// AVX2 builds (with FMA and F16C); PAGEDLLM_VEC is undefined in portable builds, whose
// kernels use their scalar loops. 16-bit types are widened exactly (bfloat16: shift left
// by 16; float16: vcvtph2ps) and narrowed with round-to-nearest-even, as PyTorch's scalar
// conversions (c10::BFloat16(float), c10::Half(float)); NaN stays NaN.
//
// vload_scaled loads values divided by a power of two, kLoadScale<T>, where that is cheaper
// (e4m3: through float16). vstore_finite stores finite values, rounded as vstore rounds them,
// subnormals included (AVX-512's bfloat16 by integer adds, also where AVX512-BF16 has
// vcvtneps2bf16, which flushes subnormals); what a NaN becomes is left open.
//
// vexp is Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, degree-5 polynomial, scaled by 2^n;
// about 1 ulp in float32, as PyTorch's Sleef exp), the same arithmetic on both ISAs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define PAGEDLLM_VEC 1
#endif

#ifdef PAGEDLLM_VEC
namespace pagedllm_simd {

// 8 16-bit values -> 8 float32 lanes, exactly (AVX2 and up; also used beside VecF by
// kernels that work in 8-lane registers on every level, such as linear_w16).
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 widen8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 float32 values, as they are (linear_rows' float32 weights).
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
// 8 int8 values -> 8 float32 lanes, exactly (sign-extended).
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 float8 e4m3 values (OCP FP8, bias 7, no infinities) -> 8 float32 lanes, exactly: the
// exponent and mantissa bits moved to float32's positions read as 2^(e - 127) x 1.m (or a
// float32 subnormal, for e = 0), times 2^120 to rebias; the sign bit moved to bit 31. NaN
// (0x7f / 0xff) becomes a large finite value: quantizers never write it.
inline __m256 widen8(const c10::Float8_e4m3fn* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256 unsigned_value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
  return _mm256_or_ps(unsigned_value, _mm256_castsi256_ps(sign));
}
// 8 float8 e5m2 values -> 8 float32 lanes, exactly: an e5m2 byte is the high byte of the
// float16 of the same value (same exponent width and bias), so it is widened as float16.
inline __m256 widen8(const c10::Float8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}

#if defined(__AVX512F__)
constexpr int kVecWidth = 16;
struct VecF {
  __m512 v;
};

inline VecF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VecF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VecF vload(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline VecF vload(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// 16 int8 values, sign-extended, exactly.
inline VecF vload(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 float8 values, exactly, as widen8 does 8.
inline VecF vload(const c10::Float8_e4m3fn* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512 unsigned_value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
  return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(unsigned_value), sign))};
}
inline VecF vload(const c10::Float8_e5m2* p) {
  const __m256i half_bits = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  return {_mm512_cvtph_ps(half_bits)};
}
// 16 e4m3 values times 2^-8 (kLoadScale): the sign-extended byte shifted left by 7, with
// bit 14 (a sign copy) cleared, is the float16 of that product, exactly (subnormals too).
inline VecF vload_scaled(const c10::Float8_e4m3fn* p) {
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80))))};
}

// float32 -> bfloat16 bits, round to nearest even; NaN -> quiet NaN.
inline __m256i bf16_bits(VecF x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x.v));
#else
  const __m512i bits = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}
inline void vstore(float* p, VecF x) { _mm512_storeu_ps(p, x.v); }
inline void vstore(c10::BFloat16* p, VecF x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x)); }
inline void vstore(c10::Half* p, VecF x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// float32 -> bfloat16 bits of finite values, round to nearest even, subnormals kept (a NaN can
// come out as an infinity or zero): integer adds on every AVX-512 level.
inline __m256i bf16_bits_finite(VecF x) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16));
}
inline void vstore_finite(c10::BFloat16* p, VecF x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits_finite(x)); }
inline VecF round_bf16(VecF x) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(x)), 16))}; }
inline VecF round_half(VecF x) { return {_mm512_cvtph_ps(_mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))}; }

inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline VecF vfnmadd(VecF a, VecF b, VecF c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
inline VecF vround_nearest(VecF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline VecF vpow2_times(VecF y, VecF n) { return {_mm512_scalef_ps(y.v, n.v)}; }  // y * 2^n, n integral
inline float vreduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }
inline float vreduce_max(VecF a) { return _mm512_reduce_max_ps(a.v); }
// Bit l set where lane l is NaN / equals s.
inline uint32_t vnan_mask(VecF a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline uint32_t veq_mask(VecF a, float s) { return _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(s), _CMP_EQ_OQ); }

#else  // AVX2 + FMA + F16C
constexpr int kVecWidth = 8;
struct VecF {
  __m256 v;
};

inline VecF vset1(float x) { return {_mm256_set1_ps(x)}; }
inline VecF vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline VecF vload(const c10::BFloat16* p) { return {widen8(p)}; }
inline VecF vload(const c10::Half* p) { return {widen8(p)}; }
inline VecF vload(const int8_t* p) { return {widen8(p)}; }
inline VecF vload(const c10::Float8_e4m3fn* p) { return {widen8(p)}; }
inline VecF vload(const c10::Float8_e5m2* p) { return {widen8(p)}; }
// 8 e4m3 values times 2^-8 (kLoadScale), exactly, as the AVX-512 vload_scaled does 16.
inline VecF vload_scaled(const c10::Float8_e4m3fn* p) {
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80))))};
}

// float32 -> bfloat16 bits (low 16 bits of each 32-bit lane), round to nearest even; NaN -> quiet NaN.
inline __m256i bf16_bits32(VecF x) {
  const __m256i bits = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}
inline void vstore(float* p, VecF x) { _mm256_storeu_ps(p, x.v); }
inline void vstore(c10::BFloat16* p, VecF x) {
  const __m256i r = bf16_bits32(x);  // values < 2^16: packus_epi32 keeps them; it packs per 128-bit lane
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void vstore(c10::Half* p, VecF x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline VecF round_bf16(VecF x) { return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits32(x), 16))}; }
inline VecF round_half(VecF x) { return {_mm256_cvtph_ps(_mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))}; }

inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vfnmadd(VecF a, VecF b, VecF c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
inline VecF vround_nearest(VecF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// y * 2^n for integral n in [-128, 128] (vexp's range), as AVX-512's scalef: two powers of
// two of at most 2^+-64 built from exponent bits, so the one rounding (to a denormal or to
// infinity) happens in the last multiply.
inline __m256 pow2_bits(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }
inline VecF vpow2_times(VecF y, VecF n) {
  const __m256i ni = _mm256_cvtps_epi32(n.v);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  return {_mm256_mul_ps(_mm256_mul_ps(y.v, pow2_bits(half)), pow2_bits(_mm256_sub_epi32(ni, half)))};
}
inline float vreduce_add(VecF a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float vreduce_max(VecF a) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline uint32_t vnan_mask(VecF a) { return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))); }
inline uint32_t veq_mask(VecF a, float s) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.v, _mm256_set1_ps(s), _CMP_EQ_OQ)));
}
#endif

// vload(p) / kLoadScale<C>: e4m3 through float16 (above), every other type as vload.
template <typename C>
inline constexpr float kLoadScale = 1.f;
template <>
inline constexpr float kLoadScale<c10::Float8_e4m3fn> = 256.f;
template <typename C>
inline VecF vload_scaled(const C* p) { return vload(p); }

// vstore for finite values (every type but AVX-512's bfloat16, above, as vstore).
template <typename T>
inline void vstore_finite(T* p, VecF x) { vstore(p, x); }

// Round each lane to T's precision and back (identity for float).
template <typename T>
inline VecF vround(VecF x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(x);
  } else {
    return round_half(x);
  }
}

// exp(x), Cephes expf; inputs clamped to +-88.376 (exp overflows / underflows beyond).
inline VecF vexp(VecF x) {
  x = vmin(vmax(x, vset1(-88.3762626647949f)), vset1(88.3762626647949f));
  const VecF n = vround_nearest(x * vset1(1.44269504088896341f));
  VecF r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  VecF p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  const VecF y = vfmadd(p * r, r, r) + vset1(1.0f);
  return vpow2_times(y, n);
}

}  // namespace pagedllm_simd
#endif  // PAGEDLLM_VEC
