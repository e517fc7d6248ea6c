// Matmul against 16-bit weights on CPUs without a native bfloat16 matmul (AVX2, AVX-512
// without AVX512-BF16): the weights stay 16-bit in memory and are widened to float32 in
// registers, so decode reads half the bytes of a float32 model and computes in float32.
//
// Registered as torch.ops.pagedllm_cpu_<level>.linear_w16 (see __init__.py):
//
//   x [M, K] float32 / bfloat16 / float16 (last dimension contiguous),
//   weight [N, K] bfloat16 / float16, contiguous (the checkpoint's layout, unchanged),
//   bias [N] (any float dtype) or None
//     ->  y = x W^T + b, [M, N] in x's dtype; float32 products and sums, one rounding at the end
//
// Few rows (M <= kStreamRows, decode steps): a weight-streaming kernel. Each thread takes
// chunks of kChunkN output rows; in a chunk, 2 or 4 weight rows are read side by side, 8
// inputs at a time (prefetched 512 bytes ahead), widened (bfloat16: zero-extend and shift
// left by 16, exact; float16: F16C's vcvtph2ps, exact) and multiplied into 8-lane float32
// accumulators with FMA, for 1-4 rows of x at once (each weight register feeds every row);
// the accumulators are summed across lanes once per output. The chunk (kChunkN x K x 2
// bytes, at most 640 KB for K = 4864) stays in L2 while the next rows of x go through it.
// This is how llama.cpp runs 16-bit GGUF weights on AVX2 (ggml_vec_dot_bf16 / _f16 widen
// in registers too).
//
// More rows (prefill, large batches): compute-bound, so the weights are widened chunk by
// chunk into a float32 buffer (16 MB: narrower chunks made MKL slower) and multiplied by
// torch's float32 GEMM (MKL / oneDNN), whose float32 throughput on AVX2 is ~5x what a
// bfloat16 GEMM gets without native bf16 (`pagedllm bench roofline` on a 2-core Zen 3:
// ~115 vs ~21 GFLOP/s). Widening costs 8-27% over a float32 weight (128 to 32 rows), so
// linear.py keeps a float32 copy for these rows where memory allows and this path serves
// the rest.
//
// Builds without AVX2 (the portable level) use the widening GEMM for every M.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_W16_STREAM 1
#endif

namespace {

constexpr int64_t kStreamRows = 16;      // x rows up to which the streaming kernel runs
constexpr int64_t kChunkN = 64;          // output rows per streaming work item
// Software prefetch of each weight row 512 bytes ahead, once per 64-byte line: the rows of
// a tile are 2-4 streams per core at once, more than the hardware prefetchers keep up with
// (1 row of x, 0.5B-shape weights, AVX2 build: 11-12 -> 13.3-14.8 GB/s; 128 or 512
// elements ahead and 6 rows at once measured no better).
constexpr int64_t kPrefetchAhead = 256;  // elements
constexpr int64_t kPrefetchEvery = 32;   // elements per cache line
constexpr int64_t kGemmChunkBytes = 16 << 20;  // float32 weight buffer per GEMM chunk (larger: MKL less efficient on narrow N)

#ifdef PAGEDLLM_W16_STREAM
// 8 weights -> float32, exactly.
PAGEDLLM_INLINE __m256 widen8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
PAGEDLLM_INLINE __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

PAGEDLLM_INLINE float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// out[r][j] = x[r] . w[n0 + j] for R rows of x (float32, row stride ldx) and NO weight rows
// (row stride k): dot products over K, float32.
template <typename W, int R, int NO>
PAGEDLLM_INLINE void dot_tile(const float* x, int64_t ldx, const W* w, int64_t k, float out[R][NO]) {
  __m256 acc[R][NO];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[NO];
    if (i % kPrefetchEvery == 0) {
      for (int j = 0; j < NO; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + i + kPrefetchAhead), _MM_HINT_T0);
    }
    for (int j = 0; j < NO; ++j) wv[j] = widen8(w + j * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int j = 0; j < NO; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NO; ++j) out[r][j] = hsum(acc[r][j]);
  for (; i < k; ++i) {
    for (int j = 0; j < NO; ++j) {
      const float wf = static_cast<float>(w[j * k + i]);
      for (int r = 0; r < R; ++r) out[r][j] += x[r * ldx + i] * wf;
    }
  }
}

// Rows [0, R) of x times weight rows [n0, n1): y[r][n] = dot + bias[n].
template <typename W, typename Y, int R, int NO>
void rows_times_chunk(const float* x, int64_t ldx, const W* w, int64_t k, const float* bias, Y* y, int64_t ldy,
                      int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NO <= n1; n += NO) {
    float out[R][NO];
    dot_tile<W, R, NO>(x, ldx, w + n * k, k, out);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NO; ++j) y[r * ldy + n + j] = static_cast<Y>(out[r][j] + (bias ? bias[n + j] : 0.f));
  }
  for (; n < n1; ++n) {
    float out[R][1];
    dot_tile<W, R, 1>(x, ldx, w + n * k, k, out);
    for (int r = 0; r < R; ++r) y[r * ldy + n] = static_cast<Y>(out[r][0] + (bias ? bias[n] : 0.f));
  }
}

template <typename W, typename Y>
void stream(const at::Tensor& x32, const at::Tensor& weight, const float* bias, at::Tensor& y) {
  const int64_t m = x32.size(0), k = x32.size(1), n = weight.size(0);
  const float* xp = x32.const_data_ptr<float>();
  const W* wp = weight.const_data_ptr<W>();
  Y* yp = y.mutable_data_ptr<Y>();
  const int64_t chunks = (n + kChunkN - 1) / kChunkN;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * kChunkN, n1 = std::min(n, n0 + kChunkN);
      int64_t r = 0;
      // Register budget (16 ymm): R x NO accumulators + NO weights + one x vector.
      for (; r + 4 <= m; r += 4) rows_times_chunk<W, Y, 4, 2>(xp + r * k, k, wp, k, bias, yp + r * n, n, n0, n1);
      for (; r + 2 <= m; r += 2) rows_times_chunk<W, Y, 2, 4>(xp + r * k, k, wp, k, bias, yp + r * n, n, n0, n1);
      for (; r < m; ++r) rows_times_chunk<W, Y, 1, 4>(xp + r * k, k, wp, k, bias, yp + r * n, n, n0, n1);
    }
  });
}
#endif

// y32 [M, N] = x32 [M, K] W^T (+ bias), W widened to float32 one L2-sized chunk of rows at a time.
void widening_gemm(const at::Tensor& x32, const at::Tensor& weight, const at::Tensor& bias_f, at::Tensor& y32) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t rows = std::max<int64_t>(64, kGemmChunkBytes / (4 * std::max<int64_t>(k, 1)) / 16 * 16);
  at::Tensor wbuf = at::empty({std::min(rows, n), k}, x32.options());
  for (int64_t n0 = 0; n0 < n; n0 += rows) {
    const int64_t nc = std::min(rows, n - n0);
    at::Tensor w32 = wbuf.narrow(0, 0, nc);
    w32.copy_(weight.narrow(0, n0, nc));
    at::Tensor out = y32.narrow(1, n0, nc);
    at::mm_out(out, x32, w32.t());
  }
  if (bias_f.defined()) y32.add_(bias_f);
}

at::Tensor linear_w16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "linear_w16: weight must be a contiguous bfloat16 or float16 CPU tensor [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "linear_w16: x must be a float32 / bfloat16 / float16 CPU tensor [M, ", k, "]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_w16: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = x.size(0);
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
#ifdef PAGEDLLM_W16_STREAM
  if (m <= kStreamRows) {
    at::Tensor y = at::empty({m, n}, x.options());
    const float* bp = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
    const bool bf16_w = weight.scalar_type() == at::kBFloat16;
#define PAGEDLLM_STREAM(Y) \
  (bf16_w ? stream<c10::BFloat16, Y>(x32, weight, bp, y) : stream<c10::Half, Y>(x32, weight, bp, y))
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
  widening_gemm(x32, weight, bias_f, y32);
  return xt == at::kFloat ? y32 : y32.to(xt);
}

}  // namespace

PAGEDLLM_FRAGMENT(m) { m.def("linear_w16(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) { m.impl("linear_w16", &linear_w16); }
