// Matmul against 16-bit weights on CPUs without a native bfloat16 matmul (AVX2, AVX-512
// without AVX512-BF16): the weights stay 16-bit in memory and are widened to float32 in
// registers, so decode reads half the bytes of a float32 model and computes in float32.
//
// Registered as torch.ops.pagedllm_cpu_<level>.pack_w16 / linear_w16 (see __init__.py):
//
//   pack_w16(weight [N, K] bfloat16 / float16)  ->  [ceil(N / 16), K, 16], same dtype
//   linear_w16(x [M, K] float32 / bfloat16 / float16 (last dimension contiguous),
//              packed weight, bias [N] (any float dtype) or None, N)
//     ->  y = x W^T + b, [M, N] in x's dtype; float32 products and sums, one rounding at the end
//
// and the same for int8 weights with one float32 scale per output (weight-only
// quantization, W = scale[n] * Q[n, k]; decode streams a quarter of float32's bytes):
//
//   pack_w8(weight [N, K] int8)  ->  [ceil(N / 16), K, 16] int8
//   linear_w8(x, packed weight, scale [N] float32, bias [N] or None, N)
//     ->  y = (x Q^T) * scale + b, float32 sums, the scale applied once per output
//
// and for float8 e4m3 weights with one scale per output (W = scale[n] * F[n, k]), packed by
// pack_w8 (their bytes viewed as int8):
//
//   linear_fp8(x, packed weight (float8_e4m3fn), scale [N] float32, bias [N] or None, N)
//
// The layout: N is cut into blocks of 16 outputs (the last one padded with zeros); block b
// holds, for each input k in order, the 16 weights (b * 16 + j, k):
//
//   element (n, k)  at  (n / 16) * K * 16  +  k * 16  +  n % 16
//
// so a block is one contiguous stream of K * 32 bytes, and input k meets its 16 outputs in
// two 8-lane registers once widened (bfloat16: zero-extend and shift left by 16, exact;
// float16: F16C's vcvtph2ps, exact; int8: sign-extend and convert, exact).
//
// Few rows (M <= kStreamRows, decode steps): each thread takes a contiguous range of
// blocks, one sequential stream per core, prefetched kPrefetchAhead elements (4 KB) ahead;
// per input k, x[r][k] is broadcast and multiplied into the 16 outputs' accumulators with
// FMA, for 1-4 rows of x at once (each weight register feeds every row; one or two rows
// alternate two accumulator sets over k, so that enough FMAs are in flight). A block (at
// most 156 KB for K = 4864) stays in L2 while the next rows of x go through it. On the
// 0.5B-shape decode matmuls (AVX2 build, 2 threads, 2-core Xeon VM where torch.sum reads
// 15-20 GB/s): 15.3-18.0 GB/s, against 13-14.7 GB/s for a row-major dot-product kernel
// (4 weight rows read side by side) and 17-19 GB/s for torch's float32 GEMV on twice the
// bytes. llama.cpp's AVX2 path for 16-bit GGUF weights widens in registers the same way.
//
// More rows (linear_w16: prefill, large batches): compute-bound, so chunks of blocks are
// widened into a float32 [K, columns] buffer (16 MB: narrower chunks made MKL slower) and multiplied by
// torch's float32 GEMM (MKL / oneDNN), whose float32 throughput on AVX2 is ~5x a bfloat16
// GEMM without native bf16 (`pagedllm bench roofline` on a 2-core Zen 3: ~115 vs ~21
// GFLOP/s). Widening cost 8-27% over a float32 weight (128 to 32 rows), so linear.py keeps a
// float32 copy for these rows where memory allows, and this path serves the rest.
//
// Builds without AVX2 (the portable level) use the widening GEMM for every M.
//
// Batch-invariant product (linear_rows, for --batch-invariant): every row of y comes from the
// same float32 operations whatever M and whichever other rows come with it, so a token's
// output does not depend on the batch, the prompt chunk or the prefix cache's state:
//
//   pack_w32(weight [N, K] float32)  ->  [ceil(N / 16), K, 16] float32 (pack_w16's layout)
//   linear_rows(x [M, K], weight packed by pack_w16 or pack_w32, bias [N] or None, N)
//     ->  [M, N] in x's dtype
//
// It is the few-rows stream above for every M, always with one accumulator set per row
// (U = 1; the plain stream uses two for one or two rows, which changes the order of the
// sums). Portable builds: a scalar loop over k in order per (row, output). The cost is a
// weight pass per 4 rows: for long prompts, several times the GEMM (docs/benchmarks.md).
//
// linear_w8 and linear_fp8 take at most kStreamRows rows: the quantized LinearMethods send
// more to linear_dequant.cpp (DEQUANT_GEMM_MIN_ROWS in __init__.py). linear_w16 takes any
// number (the lm_head, which has no float32 copy, and layers whose copy did not fit).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "simd.h"
#include "weight_blocks.h"

namespace {

using pagedllm_blocks::kBlock;
using pagedllm_blocks::kGemmChunkBytes;
using pagedllm_blocks::kStreamRows;

// Software prefetch 4 KB ahead in a block's stream, once per 64-byte line: without it
// 11-12 GB/s, 1 KB ahead 14-15.6, 4 KB 16.7-18.1, 16 KB 15.6-18.5 (same measurement).
constexpr int64_t kPrefetchAhead = 2048;   // elements

template <typename T>
void pack_rows(const T* w, int64_t n, int64_t k, T* out) {
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      T* ob = out + b * k * kBlock;
      for (int64_t j = 0; j < kBlock && b * kBlock + j < n; ++j) {
        const T* row = w + (b * kBlock + j) * k;
        for (int64_t i = 0; i < k; ++i) ob[i * kBlock + j] = row[i];
      }
    }
  });
}

at::Tensor pack_blocks(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor out = at::zeros({(n + kBlock - 1) / kBlock, k, kBlock}, w.options());
  switch (w.scalar_type()) {
    case at::kBFloat16:
      pack_rows(w.const_data_ptr<c10::BFloat16>(), n, k, out.mutable_data_ptr<c10::BFloat16>());
      break;
    case at::kHalf: pack_rows(w.const_data_ptr<c10::Half>(), n, k, out.mutable_data_ptr<c10::Half>()); break;
    default: pack_rows(w.const_data_ptr<int8_t>(), n, k, out.mutable_data_ptr<int8_t>()); break;
  }
  return out;
}

at::Tensor pack_w16(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "pack_w16: weight must be a bfloat16 or float16 CPU tensor [N, K]");
  return pack_blocks(weight);
}

at::Tensor pack_w8(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "pack_w8: weight must be an int8 CPU tensor [N, K]");
  return pack_blocks(weight);
}

#ifdef PAGEDLLM_BLOCK_STREAM
using pagedllm_simd::widen8;  // 8 weights -> float32, exactly

// Rows [0, R) of x (float32, row stride ldx) times one block wb (K x 16): y[r][j] for the
// first n_valid outputs, times scale[j] (if given), plus bias. U accumulator sets take
// alternate inputs.
template <typename W, typename Y, int R, int U>
void block_rows(const float* x, int64_t ldx, const W* wb, int64_t k, const float* scale, const float* bias, Y* y,
                int64_t ldy, int64_t n_valid) {
  __m256 acc[U][R][2];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + U <= k; i += U) {
    if (i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + i * kBlock + kPrefetchAhead), _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      const __m256 w0 = widen8(wb + (i + u) * kBlock), w1 = widen8(wb + (i + u) * kBlock + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + i + u]);
        acc[u][r][0] = _mm256_fmadd_ps(xv, w0, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xv, w1, acc[u][r][1]);
      }
    }
  }
  for (; i < k; ++i) {  // U = 2 and K odd: the last input
    const __m256 w0 = widen8(wb + i * kBlock), w1 = widen8(wb + i * kBlock + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + i]);
      acc[0][r][0] = _mm256_fmadd_ps(xv, w0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(xv, w1, acc[0][r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kBlock];
    __m256 lo = acc[0][r][0], hi = acc[0][r][1];
    for (int u = 1; u < U; ++u) {
      lo = _mm256_add_ps(lo, acc[u][r][0]);
      hi = _mm256_add_ps(hi, acc[u][r][1]);
    }
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
    for (int64_t j = 0; j < n_valid; ++j) {
      y[r * ldy + j] = static_cast<Y>((scale ? out[j] * scale[j] : out[j]) + (bias ? bias[j] : 0.f));
    }
  }
}

// kSameOrder: one accumulator set for every row count (linear_rows), see the header.
template <typename W, typename Y, bool kSameOrder = false>
void stream(const at::Tensor& x32, const at::Tensor& packed, const float* scale, const float* bias, int64_t n,
            at::Tensor& y) {
  const int64_t m = x32.size(0), k = x32.size(1);
  const float* xp = x32.const_data_ptr<float>();
  const W* wp = packed.const_data_ptr<W>();
  Y* yp = y.mutable_data_ptr<Y>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const W* wb = wp + b * k * kBlock;
      const int64_t n0 = b * kBlock, n_valid = std::min(kBlock, n - n0);
      const float* bb = bias ? bias + n0 : nullptr;
      const float* sb = scale ? scale + n0 : nullptr;
      int64_t r = 0;
      // Register budget (16 ymm): 2 R U accumulators, 2 weights, one broadcast.
      for (; r + 4 <= m; r += 4) block_rows<W, Y, 4, 1>(xp + r * k, k, wb, k, sb, bb, yp + r * n + n0, n, n_valid);
      switch (m - r) {
        case 3: block_rows<W, Y, 3, 1>(xp + r * k, k, wb, k, sb, bb, yp + r * n + n0, n, n_valid); break;
        case 2: block_rows<W, Y, 2, kSameOrder ? 1 : 2>(xp + r * k, k, wb, k, sb, bb, yp + r * n + n0, n, n_valid); break;
        case 1: block_rows<W, Y, 1, kSameOrder ? 1 : 2>(xp + r * k, k, wb, k, sb, bb, yp + r * n + n0, n, n_valid); break;
        default: break;
      }
    }
  });
}
#else
// linear_rows without vector registers: y[r][n0 + j] = sum over k in order of x[r][k] W[n0 + j][k], plus bias.
template <typename W, typename Y>
void rows_scalar(const at::Tensor& x32, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& y) {
  const int64_t m = x32.size(0), k = x32.size(1);
  const float* xp = x32.const_data_ptr<float>();
  const W* wp = packed.const_data_ptr<W>();
  Y* yp = y.mutable_data_ptr<Y>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const W* wb = wp + b * k * kBlock;
      const int64_t n0 = b * kBlock, n_valid = std::min(kBlock, n - n0);
      for (int64_t r = 0; r < m; ++r) {
        float acc[kBlock] = {};
        for (int64_t i = 0; i < k; ++i) {
          const float xv = xp[r * k + i];
          for (int64_t j = 0; j < kBlock; ++j) acc[j] += xv * static_cast<float>(wb[i * kBlock + j]);
        }
        for (int64_t j = 0; j < n_valid; ++j) yp[r * n + n0 + j] = static_cast<Y>(acc[j] + (bias ? bias[n0 + j] : 0.f));
      }
    }
  });
}
#endif

// linear_rows' product for weight dtype W (see the header): every M, every build.
template <typename W, typename Y>
void same_order_rows(const at::Tensor& x32, const at::Tensor& packed, const float* bias, int64_t n, at::Tensor& y) {
#ifdef PAGEDLLM_BLOCK_STREAM
  stream<W, Y, true>(x32, packed, nullptr, bias, n, y);
#else
  rows_scalar<W, Y>(x32, packed, bias, n, y);
#endif
}

// y32 [M, N] = x32 [M, K] W^T (* scale) (+ bias), chunks of blocks widened into a float32
// [K, columns] buffer for torch's float32 GEMM.
void widening_gemm(const at::Tensor& x32, const at::Tensor& packed, const at::Tensor& scale,
                   const at::Tensor& bias_f, int64_t n, at::Tensor& y32) {
  const int64_t nb = packed.size(0), k = packed.size(1);
  const int64_t chunk = std::max<int64_t>(4, kGemmChunkBytes / (4 * kBlock * std::max<int64_t>(k, 1)));
  at::Tensor wbuf = at::empty({k, std::min(chunk, nb) * kBlock}, x32.options());
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t bc = std::min(chunk, nb - b0), cols = std::min(bc * kBlock, n - b0 * kBlock);
    at::Tensor w32 = wbuf.narrow(1, 0, bc * kBlock);
    w32.view({k, bc, kBlock}).copy_(packed.narrow(0, b0, bc).permute({1, 0, 2}));
    at::Tensor out = y32.narrow(1, b0 * kBlock, cols);
    at::mm_out(out, x32, w32.narrow(1, 0, cols));
  }
  if (scale.defined()) y32.mul_(scale);
  if (bias_f.defined()) y32.add_(bias_f);
}

// y = x W^T (* scale) (+ bias) for a weight packed by pack_blocks; ``op`` names the caller in errors.
// x as float32 and the bias as float32 (undefined without one), after checking them against a
// weight packed by pack_blocks for N = ``n`` outputs; ``op`` names the caller in errors.
std::pair<at::Tensor, at::Tensor> checked_inputs(const char* op, const at::Tensor& x, const at::Tensor& packed,
                                                 const std::optional<at::Tensor>& bias, int64_t n) {
  const int64_t k = packed.size(1);
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlock && n <= packed.size(0) * kBlock, op, ": N = ", n,
              " does not match the packed weight's ", packed.size(0), " blocks of 16 outputs");
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              op, ": x must be a float32 / bfloat16 / float16 CPU tensor [M, ", k, "]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  return {x.to(at::kFloat).contiguous(), bias_f};
}

at::Tensor linear_blocks(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, int64_t n) {
  const auto [x32, bias_f] = checked_inputs(op, x, packed, bias, n);
  const auto xt = x.scalar_type();
  const int64_t m = x.size(0);
#ifdef PAGEDLLM_BLOCK_STREAM
  if (m <= kStreamRows) {
    at::Tensor y = at::empty({m, n}, x.options());
    const float* bp = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
    const float* sp = scale.defined() ? scale.const_data_ptr<float>() : nullptr;
    const auto wt = packed.scalar_type();
#define PAGEDLLM_STREAM(Y)                                                                 \
  (wt == at::kBFloat16 ? stream<c10::BFloat16, Y>(x32, packed, sp, bp, n, y)               \
   : wt == at::kHalf   ? stream<c10::Half, Y>(x32, packed, sp, bp, n, y)                   \
   : wt == at::kChar   ? stream<int8_t, Y>(x32, packed, sp, bp, n, y)                      \
                       : stream<c10::Float8_e4m3fn, Y>(x32, packed, sp, bp, n, y))
    switch (xt) {
      case at::kFloat: PAGEDLLM_STREAM(float); break;
      case at::kBFloat16: PAGEDLLM_STREAM(c10::BFloat16); break;
      default: PAGEDLLM_STREAM(c10::Half); break;
    }
#undef PAGEDLLM_STREAM
    return y;
  }
#endif
  at::Tensor y32 = at::empty({m, n}, x32.options());
  widening_gemm(x32, packed, scale, bias_f, n, y32);
  return xt == at::kFloat ? y32 : y32.to(xt);
}

at::Tensor linear_w16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kHalf),
              "linear_w16: weight must be a bfloat16 or float16 CPU tensor packed by pack_w16 ([N / 16, K, 16])");
  return linear_blocks("linear_w16", x, packed, at::Tensor(), bias, n);
}

at::Tensor pack_w32(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_w32: weight must be a float32 CPU tensor [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor out = at::zeros({(n + kBlock - 1) / kBlock, k, kBlock}, w.options());
  pack_rows(w.const_data_ptr<float>(), n, k, out.mutable_data_ptr<float>());
  return out;
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
  const auto wt = packed.scalar_type();
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() &&
                  (wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat),
              "linear_rows: weight must be a bfloat16 / float16 / float32 CPU tensor packed by pack_w16 or pack_w32 "
              "([N / 16, K, 16])");
  const auto [x32, bias_f] = checked_inputs("linear_rows", x, packed, bias, n);
  const auto xt = x.scalar_type();
  const float* bp = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({x.size(0), n}, x.options());
#define PAGEDLLM_ROWS(Y)                                                                \
  (wt == at::kBFloat16 ? same_order_rows<c10::BFloat16, Y>(x32, packed, bp, n, y)       \
   : wt == at::kHalf   ? same_order_rows<c10::Half, Y>(x32, packed, bp, n, y)           \
                       : same_order_rows<float, Y>(x32, packed, bp, n, y))
  switch (xt) {
    case at::kFloat: PAGEDLLM_ROWS(float); break;
    case at::kBFloat16: PAGEDLLM_ROWS(c10::BFloat16); break;
    default: PAGEDLLM_ROWS(c10::Half); break;
  }
#undef PAGEDLLM_ROWS
  return y;
}

// An 8-bit weight (int8 or float8 e4m3, ``dtype``) with one scale per output; ``op`` names the caller.
at::Tensor linear_scaled_bytes(const char* op, at::ScalarType dtype, const char* dtype_name, const at::Tensor& x,
                               const at::Tensor& packed, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                               int64_t n) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() &&
                  packed.scalar_type() == dtype,
              op, ": weight must be a CPU tensor of dtype ", dtype_name, " packed by pack_w8 ([N / 16, K, 16])");
  TORCH_CHECK(scale.device().is_cpu() && scale.dim() == 1 && scale.size(0) == n && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(),
              op, ": scale must be a contiguous float32 CPU tensor [", n, "]");
  TORCH_CHECK(x.dim() != 2 || x.size(0) <= kStreamRows, op, ": x has ", x.size(0),
              " rows; this kernel takes at most ", kStreamRows, " (more rows: linear_dequant)");
  return linear_blocks(op, x, packed, scale, bias, n);
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  return linear_scaled_bytes("linear_w8", at::kChar, "int8", x, packed, scale, bias, n);
}

at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const std::optional<at::Tensor>& bias, int64_t n) {
  return linear_scaled_bytes("linear_fp8", at::kFloat8_e4m3fn, "float8_e4m3fn", x, packed, scale, bias, n);
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("pack_w16(Tensor weight) -> Tensor");
  m.def("linear_w16(Tensor x, Tensor weight, Tensor? bias, int n) -> Tensor");
  m.def("pack_w8(Tensor weight) -> Tensor");
  m.def("pack_w32(Tensor weight) -> Tensor");
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias, int n) -> Tensor");
  m.def("linear_w8(Tensor x, Tensor weight, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("linear_fp8(Tensor x, Tensor weight, Tensor scale, Tensor? bias, int n) -> Tensor");
}

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) {
  m.impl("pack_w16", &pack_w16);
  m.impl("linear_w16", &linear_w16);
  m.impl("pack_w8", &pack_w8);
  m.impl("pack_w32", &pack_w32);
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_w8", &linear_w8);
  m.impl("linear_fp8", &linear_fp8);
}
