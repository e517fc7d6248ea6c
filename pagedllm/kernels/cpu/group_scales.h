// The scales and zero points of weights quantized in groups of inputs, W = scale * (Q - zero)
// per group, as linear_grouped.cpp and linear_dequant.cpp read them:
//
//   scale [N, G] float32, or float16 (llama.cpp's Q4_0 / Q8_0 and GPTQ / AWQ checkpoints store
//         float16 scales; the Python side keeps them so where that is exact: half the bytes);
//   zero  [N, G] float32, or none: symmetric weights, zero 2^(bits - 1) everywhere (Q4_0, Q8_0,
//         GPTQ sym, --quantization int4), whose zero points need not be read at all;
//
// or both blocked as the weights are ([ceil(N / 16), G, 16], pack_groups in __init__.py: per
// block of 16 outputs and group, the 16 values side by side, zero padded), which the few-row
// kernels load with one vector load per group instead of a 16-lane gather.
//
// At groups of 32 inputs a 4-bit weight block streams 16 bytes per output and group; float32
// scale and zero add 8 more (1.5x the bytes), a float16 scale alone 2 (1.125x, as Q4_0).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "weight_blocks.h"

namespace pagedllm_groups {

using pagedllm_blocks::kBlock;

struct Groups {
  const float* scale32 = nullptr;     // float32 scales, or null
  const c10::Half* scale16 = nullptr;  // float16 scales (4-byte aligned), or null
  const float* zero = nullptr;        // zero points, or null: mid everywhere
  float mid = 0.f;                    // 2^(bits - 1)
  int64_t groups = 1;                 // G
  bool blocked = false;               // [ceil(N / 16), G, 16], else [N, G]

  // Where output j's value of group g is.
  int64_t index(int64_t j, int64_t g) const {
    return blocked ? ((j / kBlock) * groups + g) * kBlock + j % kBlock : j * groups + g;
  }
  float scale(int64_t j, int64_t g) const {
    const int64_t i = index(j, g);
    return scale16 != nullptr ? static_cast<float>(scale16[i]) : scale32[i];
  }
  float zero_at(int64_t j, int64_t g) const { return zero != nullptr ? zero[index(j, g)] : mid; }
  // The rows from output n0 on (n0 a multiple of 16 when blocked: the same offset either way).
  Groups from_row(int64_t n0) const {
    Groups g = *this;
    if (scale32 != nullptr) g.scale32 += n0 * groups;
    if (scale16 != nullptr) g.scale16 += n0 * groups;
    if (zero != nullptr) g.zero += n0 * groups;
    return g;
  }
};

// Checks scale ([n, G] or blocked [ceil(n / 16), G, 16]; float32 / float16, contiguous, G >= 1)
// and zero (undefined, or float32 shaped like scale) for op ``op``, and views them; a float16
// scale not 4-byte aligned (a view at an odd offset) is copied into ``holder`` first (the vector
// gathers read aligned words).
inline Groups view_groups(const char* op, const at::Tensor& scale, const at::Tensor& zero, int64_t n, int64_t bits,
                          at::Tensor& holder) {
  const auto st = scale.scalar_type();
  const bool blocked = scale.dim() == 3;
  const bool shaped = blocked ? scale.size(0) == (n + kBlock - 1) / kBlock && scale.size(2) == kBlock
                              : scale.dim() == 2 && scale.size(0) == n;
  TORCH_CHECK(scale.device().is_cpu() && shaped && scale.size(1) >= 1 && (st == at::kFloat || st == at::kHalf) &&
                  scale.is_contiguous(),
              op, ": scale must be a contiguous float32 or float16 CPU tensor [", n, ", G] or [",
              (n + kBlock - 1) / kBlock, ", G, 16] (pack_groups)");
  TORCH_CHECK(!zero.defined() || (zero.sizes() == scale.sizes() && zero.scalar_type() == at::kFloat && zero.is_contiguous()),
              op, ": zero must be None or a contiguous float32 tensor shaped like scale");
  Groups g;
  g.groups = scale.size(1);
  g.blocked = blocked;
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
