// The scales and zero points of weights quantized in groups of inputs, W = scale * (Q - zero)
// per group, as linear_grouped.cpp and linear_dequant.cpp read them:
//
//   scale [N, G] float32, or float16 (llama.cpp's Q4_0 / Q8_0 and GPTQ / AWQ checkpoints store
//         float16 scales; the Python side keeps them so where that is exact: half the bytes);
//   zero  [N, G] float32, or none: symmetric weights, zero 2^(bits - 1) everywhere (Q4_0, Q8_0,
//         GPTQ sym, --quantization int4), whose zero points need not be read at all.
//
// At groups of 32 inputs a 4-bit weight block streams 16 bytes per output and group; float32
// scale and zero add 8 more (1.5x the bytes), a float16 scale alone 2 (1.125x, as Q4_0).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace pagedllm_groups {

struct Groups {
  const float* scale32 = nullptr;     // float32 scales, or null
  const c10::Half* scale16 = nullptr;  // float16 scales (4-byte aligned), or null
  const float* zero = nullptr;        // zero points, or null: mid everywhere
  float mid = 0.f;                    // 2^(bits - 1)
  int64_t groups = 1;                 // G, the row stride of scale and zero

  float scale(int64_t idx) const { return scale16 != nullptr ? static_cast<float>(scale16[idx]) : scale32[idx]; }
  float zero_at(int64_t idx) const { return zero != nullptr ? zero[idx] : mid; }
  // The rows from output n0 on.
  Groups from_row(int64_t n0) const {
    Groups g = *this;
    if (scale32 != nullptr) g.scale32 += n0 * groups;
    if (scale16 != nullptr) g.scale16 += n0 * groups;
    if (zero != nullptr) g.zero += n0 * groups;
    return g;
  }
};

// Checks scale [n, G] (float32 / float16, contiguous, G >= 1) and zero (undefined, or float32
// shaped like scale) for op ``op``, and views them; a float16 scale not 4-byte aligned (a view
// at an odd offset) is copied into ``holder`` first (the vector gathers read aligned words).
inline Groups view_groups(const char* op, const at::Tensor& scale, const at::Tensor& zero, int64_t n, int64_t bits,
                          at::Tensor& holder) {
  const auto st = scale.scalar_type();
  TORCH_CHECK(scale.device().is_cpu() && scale.dim() == 2 && scale.size(0) == n && scale.size(1) >= 1 &&
                  (st == at::kFloat || st == at::kHalf) && scale.is_contiguous(),
              op, ": scale must be a contiguous float32 or float16 CPU tensor [", n, ", G]");
  TORCH_CHECK(!zero.defined() || (zero.sizes() == scale.sizes() && zero.scalar_type() == at::kFloat && zero.is_contiguous()),
              op, ": zero must be None or a contiguous float32 tensor shaped like scale");
  Groups g;
  g.groups = scale.size(1);
  g.mid = static_cast<float>(1 << (bits - 1));
  g.zero = zero.defined() ? zero.const_data_ptr<float>() : nullptr;
  if (st == at::kFloat) {
    g.scale32 = scale.const_data_ptr<float>();
  } else {
    holder = reinterpret_cast<uintptr_t>(scale.const_data_ptr()) % 4 == 0 ? scale : scale.clone();
    g.scale16 = holder.const_data_ptr<c10::Half>();
  }
  return g;
}

}  // namespace pagedllm_groups
