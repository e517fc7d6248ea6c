// Matmul against 4- and 8-bit unsigned weights with one scale (float32 or float16) and zero
// point (float32, or none for symmetric weights) per group of inputs (weight-only quantization:
// the arithmetic of GPTQ, AWQ, compressed-tensors' W4A16 / W8A16 and llama.cpp's Q4_0, Q4_1 and
// Q8_0 blocks; group_scales.h):
//
//   W[n, k] = scale[n, g] * (Q[n, k] - zero[n, g]),   g = k / group_size,  Q in [0, 2^bits)
//
// Registered as torch.ops.pagedllm_cpu_<level>.pack_w4 / linear_w4 / linear_w8g (see __init__.py):
//
//   pack_w4(q [N, K] uint8, values 0-15, K even)  ->  [ceil(N / 16), K / 2, 16] uint8
//   linear_w4(x [M, K] float32 / bfloat16 / float16, packed weight, scale [N, G] float32 or
//             float16, zero [N, G] float32 or None (symmetric: 2^(bits - 1)), or both blocked
//             [ceil(N / 16), G, 16] (group_scales.h), bias [N] or None, N)
//     ->  x W^T + b, [M, N] in x's dtype
//   linear_w8g(x, weight [ceil(N / 16), K, 16] uint8 (pack_w8's layout), scale, zero, bias, N)
//
// (both with a last argument int8_x: see "int8 activations" below).
//
// The layout is linear_w16.cpp's blocks of 16 outputs; 4-bit weights hold two inputs per byte:
// byte (b, i, j) holds Q[b * 16 + j, 2 i] in its low nibble and Q[b * 16 + j, 2 i + 1] in its
// high nibble, so a block is one contiguous stream of K * 8 bytes (a quarter of bfloat16's).
//
// Few rows (M <= kStreamRows, decode): per block, per group, the 16 outputs' sums
// acc[j] = sum_k x[k] Q[n, k] are accumulated in float32 (FMA on nibbles widened to float32,
// exact), then folded in once per group as scale * acc - scale * zero * sum_k x[k], with the
// per-group sums of x computed once per row for all blocks. Integers up to 15 and their
// products are exact in float32, so the only rounding is the float32 summation's.
//
// int8 activations (int8_x, M <= kStreamRows, group size a multiple of 32; every ISA level,
// the portable one included): x is quantized per block of 32 inputs (d, a, asum; int8_dot.h),
// each block's 16 outputs get exact int32 dots, folded in float32 per activation block as
// d * (dot - zero * asum) and scaled once per group. llama.cpp's arithmetic for Q8_0 / Q4_0
// weights; it reads the same bytes as the float path but does 4 multiply-adds per byte lane
// per instruction instead of one float32 FMA per widened weight.
//
// Builds without AVX2 (the portable level), for float32 activations: chunks of blocks are
// dequantized into a float32 [K, columns] buffer and multiplied by torch's float32 GEMM.
//
// At most kStreamRows rows: the quantized LinearMethods send more to linear_dequant.cpp
// (DEQUANT_GEMM_MIN_ROWS in __init__.py), and these ops refuse them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "group_scales.h"
#include "int8_dot.h"
#include "simd.h"
#include "weight_blocks.h"

namespace {

using pagedllm_blocks::kBlock;
using pagedllm_blocks::kGemmChunkBytes;
using pagedllm_groups::Groups;
using pagedllm_blocks::kStreamRows;
using pagedllm_int8::bytes_per_input;  // bytes of one block per input (a block holds 16 outputs)

constexpr int64_t kPrefetchBytes = 2048;  // software prefetch distance in a block's stream
constexpr int kInt8Rows = 4;              // rows of x per pass over a block with int8 activations

at::Tensor pack_w4(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kByte,
              "pack_w4: weight must be a uint8 CPU tensor [N, K] of values 0-15");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_w4: K = ", weight.size(1), " must be even");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = (n + kBlock - 1) / kBlock;
  at::Tensor out = at::zeros({nb, k / 2, kBlock}, w.options());
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint8_t* ob = dst + b * (k / 2) * kBlock;
      for (int64_t j = 0; j < kBlock && b * kBlock + j < n; ++j) {
        const uint8_t* row = src + (b * kBlock + j) * k;
        for (int64_t i = 0; i < k / 2; ++i) {
          ob[i * kBlock + j] = static_cast<uint8_t>((row[2 * i] & 0x0F) | ((row[2 * i + 1] & 0x0F) << 4));
        }
      }
    }
  });
  return out;
}


// One block of 16 outputs as the few-row kernels see it: its weights, first output, outputs
// in range, and its rows of scale and zero point and of bias (null without bias).
struct BlockView {
  const uint8_t* wb;
  int64_t n0, n_valid;
  Groups gs;
  const float* bb;
};

// fn(BlockView) for every block of the packed weight, blocks split across threads.
template <int Bits, typename Fn>
void for_each_block(const at::Tensor& packed, int64_t k, int64_t n, const Groups& gs, const float* bias, const Fn& fn) {
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock;
      fn(BlockView{wp + b * k * bytes_per_input<Bits>(), n0, std::min(kBlock, n - n0), gs.from_row(n0),
                   bias ? bias + n0 : nullptr});
    }
  });
}

#ifdef PAGEDLLM_BLOCK_STREAM
// 16 unsigned bytes of one input (for 4 bits: low or high nibbles, already masked) -> two
// 8-lane float32.
inline void widen16(__m128i bytes, __m256& w0, __m256& w1) {
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
}

// Rows [0, R) of x (float32, row stride ldx; xsum [R][G] its per-group sums) times one block
// wb (K x 16 weights of Bits bits) with its groups' scale / zero rows gs: y for the first
// n_valid outputs, plus bias.
template <int Bits, typename Y, int R>
void block_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* wb, int64_t group_size,
                const Groups& gs, const float* bias, Y* y, int64_t ldy, int64_t n_valid) {
  const int64_t groups = gs.groups;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 out[R][2];
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    alignas(32) float s[kBlock] = {}, sz[kBlock] = {};
    for (int64_t j = 0; j < n_valid; ++j) {
      s[j] = gs.scale(j, g);
      sz[j] = s[j] * gs.zero_at(j, g);
    }
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = g * group_size; i < (g + 1) * group_size; i += 2) {
      // Inputs i and i + 1: one byte each (8 bits), or the two nibbles of one (4 bits).
      const uint8_t* p = wb + i * bytes_per_input<Bits>();
      if (i % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      __m256 e0, e1, o0, o1;
      if constexpr (Bits == 4) {
        widen16(_mm_and_si128(bytes, low4), e0, e1);
        widen16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), o0, o1);
      } else {
        widen16(bytes, e0, e1);
        widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBlock)), o0, o1);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_set1_ps(x[r * ldx + i]), xo = _mm256_set1_ps(x[r * ldx + i + 1]);
        acc[r][0] = _mm256_fmadd_ps(xe, e0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xe, e1, acc[r][1]);
        acc[r][0] = _mm256_fmadd_ps(xo, o0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xo, o1, acc[r][1]);
      }
    }
    const __m256 s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8);
    const __m256 z0 = _mm256_load_ps(sz), z1 = _mm256_load_ps(sz + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(xsum[r * groups + g]);
      out[r][0] = _mm256_fnmadd_ps(z0, xs, _mm256_fmadd_ps(s0, acc[r][0], out[r][0]));
      out[r][1] = _mm256_fnmadd_ps(z1, xs, _mm256_fmadd_ps(s1, acc[r][1], out[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float o[kBlock];
    _mm256_store_ps(o, out[r][0]);
    _mm256_store_ps(o + 8, out[r][1]);
    for (int64_t j = 0; j < n_valid; ++j) y[r * ldy + j] = static_cast<Y>(o[j] + (bias ? bias[j] : 0.f));
  }
}

template <int Bits, typename Y>
void stream(const at::Tensor& x32, const at::Tensor& packed, const Groups& gs, const float* bias, int64_t n,
            at::Tensor& y) {
  const int64_t m = x32.size(0), k = x32.size(1), groups = gs.groups, group_size = k / groups;
  const float* xp = x32.const_data_ptr<float>();
  const at::Tensor xsum_t = x32.view({m, groups, group_size}).sum(2).contiguous();
  const float* xs = xsum_t.const_data_ptr<float>();
  Y* yp = y.mutable_data_ptr<Y>();
  for_each_block<Bits>(packed, k, n, gs, bias, [&](const BlockView& v) {
    int64_t r = 0;
    // Register budget (16 ymm): 4 R accumulators and outputs, 4 widened weights, broadcasts.
    for (; r + 2 <= m; r += 2) {
      block_rows<Bits, Y, 2>(xp + r * k, k, xs + r * groups, v.wb, group_size, v.gs, v.bb, yp + r * n + v.n0, n,
                             v.n_valid);
    }
    if (r < m) {
      block_rows<Bits, Y, 1>(xp + r * k, k, xs + r * groups, v.wb, group_size, v.gs, v.bb, yp + r * n + v.n0, n,
                             v.n_valid);
    }
  });
}
#endif


// Few rows with int8 activations (int8_dot.h): rows [0, R) of the quantized x (a, row stride
// lda; d / asum [R][xblocks]) times one block wb with its groups' scale / zero rows gs: per
// activation block the 16 outputs' exact int32 dots, folded in float32 as
// d * (dot - (zero - offset) * asum), then scaled once per group.
template <int Bits, typename Y, int R>
void block_rows_int8(const int8_t* a, int64_t lda, const float* d, const int32_t* asum, int64_t xblocks,
                     int64_t group_size, const uint8_t* wb, const Groups& gs, const float* bias, Y* y, int64_t ldy,
                     int64_t n_valid) {
  using namespace pagedllm_int8;
  Sums out[R];
  for (int r = 0; r < R; ++r) out[r] = sums_zero();
  const int64_t groups = gs.groups, per_group = group_size / kXBlock;
  const float offset = static_cast<float>(kOffset<Bits>);
  const Sums symmetric_zero = sums_set1(gs.mid - offset);
  for (int64_t g = 0; g < groups; ++g) {
    Sums sv, zv = symmetric_zero;
    if (gs.blocked) {  // this block's 16 values of group g, side by side
      sv = gs.scale16 != nullptr ? sums_load(gs.scale16 + g * kBlock, 0.f) : sums_load(gs.scale32 + g * kBlock, 0.f);
      if (gs.zero != nullptr) zv = sums_load(gs.zero + g * kBlock, offset);
    } else {
      sv = gs.scale16 != nullptr ? sums_gather_half(gs.scale16 + g, groups, n_valid)
                                 : sums_gather(gs.scale32 + g, groups, n_valid, 0.f);
      if (gs.zero != nullptr) zv = sums_gather(gs.zero + g, groups, n_valid, offset);
    }
    Sums t[R];
    for (int r = 0; r < R; ++r) t[r] = sums_zero();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* wp = wb + b * kXBlock * bytes_per_input<Bits>();
      for (int64_t line = 0; line < kXBlock * bytes_per_input<Bits>(); line += 64) __builtin_prefetch(wp + kPrefetchBytes + line);
      Lanes acc[R];
      for (int r = 0; r < R; ++r) acc[r] = lanes_zero();
      dot32<Bits, R>(wp, a + b * kXBlock, lda, acc);
      for (int r = 0; r < R; ++r) {
        fold_block(t[r], acc[r], zv, d[r * xblocks + b], static_cast<float>(asum[r * xblocks + b]));
      }
    }
    for (int r = 0; r < R; ++r) fold_group(out[r], sv, t[r]);
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float o[kBlock];
    sums_store(o, out[r]);
    for (int64_t j = 0; j < n_valid; ++j) y[r * ldy + j] = static_cast<Y>(o[j] + (bias ? bias[j] : 0.f));
  }
}

template <int Bits, typename Y>
void stream_int8(const at::Tensor& x32, const at::Tensor& packed, const Groups& gs, const float* bias, int64_t n,
                 at::Tensor& y) {
  using pagedllm_int8::kXBlock;
  const int64_t m = x32.size(0), k = x32.size(1), group_size = k / gs.groups, xblocks = k / kXBlock;
  at::Tensor a_t = at::empty({m, k}, x32.options().dtype(at::kChar));
  at::Tensor d_t = at::empty({m, xblocks}, x32.options());
  at::Tensor asum_t = at::empty({m, xblocks}, x32.options().dtype(at::kInt));
  int8_t* ap = a_t.mutable_data_ptr<int8_t>();
  float* dp = d_t.mutable_data_ptr<float>();
  int32_t* sp = asum_t.mutable_data_ptr<int32_t>();
  pagedllm_int8::quantize_rows(x32.const_data_ptr<float>(), m, k, ap, dp, sp);
  Y* yp = y.mutable_data_ptr<Y>();
  for_each_block<Bits>(packed, k, n, gs, bias, [&](const BlockView& v) {
#define PAGEDLLM_ROWS(R)                                                                                              \
  block_rows_int8<Bits, Y, R>(ap + r * k, k, dp + r * xblocks, sp + r * xblocks, xblocks, group_size, v.wb, v.gs, v.bb, \
                              yp + r * n + v.n0, n, v.n_valid)
    int64_t r = 0;
    for (; r + kInt8Rows <= m; r += kInt8Rows) PAGEDLLM_ROWS(kInt8Rows);
    switch (m - r) {
      case 3: PAGEDLLM_ROWS(3); break;
      case 2: PAGEDLLM_ROWS(2); break;
      case 1: PAGEDLLM_ROWS(1); break;
      default: break;
    }
#undef PAGEDLLM_ROWS
  });
}

// y32 [M, N] = x32 [M, K] W^T (+ bias), chunks of blocks dequantized into a float32
// [K, columns] buffer for torch's float32 GEMM: the few-row path of builds without a
// streaming kernel for these activations.
template <int Bits>
void dequantizing_gemm(const at::Tensor& x32, const at::Tensor& packed, const Groups& gs, const at::Tensor& bias_f,
                       int64_t n, at::Tensor& y32) {
  const int64_t nb = packed.size(0), k = x32.size(1), groups = gs.groups, group_size = k / groups;
  const int64_t chunk = std::max<int64_t>(4, kGemmChunkBytes / (4 * kBlock * std::max<int64_t>(k, 1)));
  at::Tensor wbuf = at::empty({k, std::min(chunk, nb) * kBlock}, x32.options());
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t bc = std::min(chunk, nb - b0), cols = std::min(bc * kBlock, n - b0 * kBlock);
    const int64_t width = bc * kBlock;
    float* w32 = wbuf.mutable_data_ptr<float>();
    at::parallel_for(0, k / 2, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t g = (2 * i) / group_size;
        float* even = w32 + (2 * i) * width;
        float* odd = even + width;
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t nn = b0 * kBlock + c;
          const uint8_t* block = wp + (nn / kBlock) * k * bytes_per_input<Bits>() + nn % kBlock;
          const float s = gs.scale(nn, g), z = gs.zero_at(nn, g);
          if constexpr (Bits == 4) {
            const uint8_t byte = block[i * kBlock];
            even[c] = s * (static_cast<float>(byte & 0x0F) - z);
            odd[c] = s * (static_cast<float>(byte >> 4) - z);
          } else {
            even[c] = s * (static_cast<float>(block[2 * i * kBlock]) - z);
            odd[c] = s * (static_cast<float>(block[(2 * i + 1) * kBlock]) - z);
          }
        }
      }
    });
    at::Tensor out = y32.narrow(1, b0 * kBlock, cols);
    at::mm_out(out, x32, wbuf.narrow(1, 0, width).narrow(1, 0, cols));
  }
  if (bias_f.defined()) y32.add_(bias_f);
}

// A few-row kernel: y [M, N] from x32, the packed weight, scales and zero points, bias, N.
using StreamFn = void (*)(const at::Tensor&, const at::Tensor&, const Groups&, const float*, int64_t, at::Tensor&);

// The streaming kernel for output type Y: int8 activations where asked and the groups are whole
// activation blocks, else the float32 streaming kernel (AVX2 and up), else none (the GEMM).
template <int Bits, typename Y>
StreamFn few_rows(bool int8_x, int64_t group_size) {
  if (int8_x && group_size % pagedllm_int8::kXBlock == 0) return &stream_int8<Bits, Y>;
#ifdef PAGEDLLM_BLOCK_STREAM
  return &stream<Bits, Y>;
#else
  return nullptr;
#endif
}

// x W^T + b for Bits-bit weights in blocks of 16 outputs; ``op`` names the caller in errors.
template <int Bits>
at::Tensor linear_grouped(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const std::optional<at::Tensor>& zero_opt, const std::optional<at::Tensor>& bias, int64_t n,
                          bool int8_x) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              op, Bits == 4 ? ": weight must be a uint8 CPU tensor packed by pack_w4 ([N / 16, K / 2, 16])"
                            : ": weight must be a uint8 CPU tensor in pack_w8's layout ([N / 16, K, 16])");
  const int64_t k = packed.size(1) * kBlock / bytes_per_input<Bits>();
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlock && n <= packed.size(0) * kBlock, op, ": N = ", n,
              " does not match the packed weight's ", packed.size(0), " blocks of 16 outputs");
  at::Tensor scale_holder;
  const Groups gs = pagedllm_groups::view_groups(op, scale, zero_opt.has_value() ? *zero_opt : at::Tensor(), n, Bits,
                                                 scale_holder);
  TORCH_CHECK(k % gs.groups == 0 && (k / gs.groups) % 2 == 0, op, ": scale's ", gs.groups,
              " groups must divide K = ", k, " into groups of an even size");
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              op, ": x must be a float32 / bfloat16 / float16 CPU tensor [M, ", k, "]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = x.size(0), group_size = k / scale.size(1);
  TORCH_CHECK(m <= kStreamRows, op, ": x has ", m, " rows; this kernel takes at most ", kStreamRows,
              " (more rows: linear_dequant)");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const StreamFn fn = xt == at::kFloat      ? few_rows<Bits, float>(int8_x, group_size)
                      : xt == at::kBFloat16 ? few_rows<Bits, c10::BFloat16>(int8_x, group_size)
                                            : few_rows<Bits, c10::Half>(int8_x, group_size);
  if (fn != nullptr) {
    at::Tensor y = at::empty({m, n}, x.options());
    fn(x32, packed, gs, bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr, n, y);
    return y;
  }
  at::Tensor y32 = at::empty({m, n}, x32.options());
  dequantizing_gemm<Bits>(x32, packed, gs, bias_f, n, y32);
  return xt == at::kFloat ? y32 : y32.to(xt);
}

at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& bias, int64_t n, bool int8_x) {
  return linear_grouped<4>("linear_w4", x, packed, scale, zero, bias, n, int8_x);
}

at::Tensor linear_w8g(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const std::optional<at::Tensor>& zero, const std::optional<at::Tensor>& bias, int64_t n, bool int8_x) {
  return linear_grouped<8>("linear_w8g", x, packed, scale, zero, bias, n, int8_x);
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("pack_w4(Tensor weight) -> Tensor");
  m.def("linear_w4(Tensor x, Tensor weight, Tensor scale, Tensor? zero, Tensor? bias, int n, bool int8_x) -> Tensor");
  m.def("linear_w8g(Tensor x, Tensor weight, Tensor scale, Tensor? zero, Tensor? bias, int n, bool int8_x) -> Tensor");
}

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) {
  m.impl("pack_w4", &pack_w4);
  m.impl("linear_w4", &linear_w4);
  m.impl("linear_w8g", &linear_w8g);
}
