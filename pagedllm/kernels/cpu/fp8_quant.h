// Float8 quantization of one float32 value, as torch's saturating cast: the bytes that
// (x / scale).clamp(-max, max).to(float8) gives, for the KV cache writes (kv_cache_write.cpp).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "library.h"

namespace pagedllm_fp8 PAGEDLLM_HIDDEN {

// The FP8 bits of x (float32 in the format's range [-max, max], or NaN), round to nearest even,
// without branches so the loops vectorize. kMantissa bits are kept; normal numbers drop the
// other 23 - kMantissa with rounding carried into the exponent, rebiased by 127 - kBias;
// below the smallest normal 2^(1 - kBias), |x| + 2^(24 - kBias - kMantissa) rounds |x| to the
// subnormal step 2^(1 - kBias - kMantissa) in float32 and its low bits count the steps. NaN
// -> 0x7f with the sign, as c10's conversions.
template <int kMantissa, int kBias>
inline uint8_t fp8_bits(float x) {
  constexpr int kDrop = 23 - kMantissa;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kBias) << 23;  // 2^(1 - kBias)
  constexpr float kMagic = static_cast<float>(1u << (24 - kBias - kMantissa));  // float32 step there: the FP8 one
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t sign = (u >> 24) & 0x80u, magnitude = u & 0x7fffffffu;
  const uint32_t normal = ((magnitude + ((1u << (kDrop - 1)) - 1) + ((magnitude >> kDrop) & 1u)) >> kDrop) -
                          (static_cast<uint32_t>(127 - kBias) << kMantissa);
  float absolute, shifted;
  std::memcpy(&absolute, &magnitude, sizeof(absolute));
  shifted = absolute + kMagic;
  uint32_t shifted_bits, magic_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const float magic = kMagic;
  std::memcpy(&magic_bits, &magic, sizeof(magic_bits));
  const uint32_t subnormal = shifted_bits - magic_bits;
  uint32_t bits = magnitude < kMinNormal ? subnormal : normal;
  bits = magnitude > 0x7f800000u ? 0x7fu : bits;
  return static_cast<uint8_t>(bits | sign);
}

template <typename C>
inline C to_cache(float x, float scale) {
  if constexpr (std::is_same<C, c10::Float8_e4m3fn>::value) {
    return C(fp8_bits<3, 7>(std::clamp(x / scale, -448.f, 448.f)), C::from_bits());
  } else if constexpr (std::is_same<C, c10::Float8_e5m2>::value) {
    return C(fp8_bits<2, 15>(std::clamp(x / scale, -57344.f, 57344.f)), C::from_bits());
  } else {
    return static_cast<C>(x);
  }
}


}  // namespace pagedllm_fp8
