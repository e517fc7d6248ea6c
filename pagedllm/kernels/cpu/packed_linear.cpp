// Matmul of a few rows against a bfloat16 weight in oneDNN's packed layout, for CPU decode
// steps with few requests (batch-1 decode above all).
//
// Registered as torch.ops.pagedllm_cpu_<level>.packed_linear (see __init__.py):
//
//   x [M, K] bfloat16 (last dimension contiguous), weight [N, K] bfloat16 as returned by
//   torch.ops.mkldnn._reorder_linear_weight, bias [N] (bfloat16 / float32) or None,
//   block_n (64 or 32: the layout's outputs per block, see below)
//     ->  y = x W^T + b, [M, N] bfloat16 (float32 accumulation, one rounding at the end)
//
// Why: a decode step with one request reads every weight once per token, so its speed is
// the memory bandwidth its matmuls reach. On the 97 matmuls of a Qwen2.5-0.5B-shaped decode
// step (2-core Zen 4 VM, alternating in one process), oneDNN's matmul streamed the packed
// weights at 20-29 GB/s and this kernel at 28-46 GB/s: 1.3-1.6x at every row count from 1
// to 16 (the VM's bandwidth varies from minute to minute; torch.sum reads 33-35 GB/s).
//
// The layout (oneDNN's "BA16a64b2a" for a K x N weight on AVX512-BF16 CPUs, "BA16a32b2a"
// where oneDNN uses AMX; linear.py checks which on each shape before this kernel is used):
// N is cut into blocks of NB = 64 (or 32) outputs and K padded to a multiple of 32, with
// zeros. Block nb holds, for each pair of inputs p = k / 2 in order, NB outputs x 2 inputs:
//
//   element (n, k)  at  (n / NB) * Kpad * NB  +  (k / 2) * 2 NB  +  (n % NB) * 2  +  k % 2
//
// so the weights of one block are one contiguous stream of Kpad * 2 NB bytes, and a pair of
// inputs meets its NB outputs in NB / 16 512-bit registers: exactly the operand order of
// AVX512-BF16's vdpbf16ps (acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1]). Each thread takes
// whole blocks (one sequential stream per core, prefetched 4 KB ahead). Rows
// of x go up to 8 (32-output blocks) or 6 (64-output blocks) at a time, each weight register
// feeding them all; a block's stream (at most Kpad * 128 bytes, 622 KB for K = 4864) stays
// in L2 for the next rows.
//
// Source of the layout: oneDNN's memory format tags (oneDNN developer guide, "Memory Format
// Propagation" and dnnl_format_tag_t); the kernel reads the memory through the
// torch.ops.mkldnn.data_ptr operator.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockK = 32;  // K is padded to a multiple of this
// Software prefetch 4 KB ahead in the block's stream, once per 64-byte line. On a 2-core
// Xeon VM with AMX (32-output blocks; torch.sum reads 15-20 GB/s), the 0.5B-shape decode
// matmuls went from 13.2-13.5 to 16.0-17.6 GB/s at 1 row and from 8.7-9.8 to 16.2-16.7 GB/s
// at 4 rows (1 KB ahead: 15.6-16.8; oneDNN's own matmul: 9-10.5). An earlier measurement on
// a Zen 4 VM, where the kernel already streamed at 28-46 GB/s, found prefetching slower at
// some distance: re-measure there.
constexpr int64_t kPrefetchAhead = 2048;  // elements

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int64_t mkldnn_data_ptr(const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "").typed<int64_t(const at::Tensor&)>();
  return op.call(packed);
}

int64_t mkldnn_nbytes(const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "").typed<int64_t(const at::Tensor&)>();
  return op.call(packed);
}

#if defined(__AVX512BF16__)
// Rows [0, R) of x (as input pairs, row stride x_stride pairs) times one NB-output block w
// (npairs pairs of inputs), plus bias, into y (row stride y_stride elements), n_valid <= NB
// outputs written.
template <int NB, int R>
void block_rows(const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t npairs, const float* bias,
                c10::BFloat16* y, int64_t y_stride, int64_t n_valid) {
  constexpr int V = NB / 16;  // registers per pair of inputs
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < npairs; ++p) {
    const uint16_t* wp = w + p * 2 * NB;
    for (int j = 0; j < V; ++j) _mm_prefetch(reinterpret_cast<const char*>(wp + 32 * j + kPrefetchAhead), _MM_HINT_T0);
    __m512bh b[V];
    for (int j = 0; j < V; ++j) b[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride * 2 + p * 2, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int j = 0; j < V; ++j) {
    const int64_t valid = n_valid - j * 16;
    if (valid <= 0) break;
    const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      // vcvtneps2bf16 rounds to nearest even, as oneDNN's and PyTorch's float -> bf16.
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(y + r * y_stride + j * 16, mask, out);
    }
  }
}
#endif

}  // namespace

#if defined(__AVX512BF16__)
// Rows of x per pass over a block: R rows keep R * NB / 16 accumulators and NB / 16 weight
// registers live (of 32 zmm), so 8 rows for 32-output blocks, 6 for 64-output ones. One pass
// for up to kMaxRows<NB> rows matters for speculative decoding's verifying step (1 + k rows
// at batch 1): with four rows per pass, 5 rows took two passes, the second with only NB / 16
// dependency chains, and cost ~1.9x one row; in one pass the block's stream is read once and
// the dot products stay hidden behind it.
template <int NB>
constexpr int kMaxRows = NB == 32 ? 8 : 6;

// Rows [r, r + R) of x against one block, R = rows (1 .. kMaxRows<NB>), by a switch over
// the instantiated row counts.
template <int NB, int R = kMaxRows<NB>>
void block_rows_n(int rows, const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t npairs, const float* bias,
                  c10::BFloat16* y, int64_t y_stride, int64_t n_valid) {
  if constexpr (R >= 1) {
    if (rows == R) return block_rows<NB, R>(w, x, x_stride, npairs, bias, y, y_stride, n_valid);
    block_rows_n<NB, R - 1>(rows, w, x, x_stride, npairs, bias, y, y_stride, n_valid);
  }
}

// Every NB-output block of the weight against the rows of x, blocks split over the threads.
template <int NB>
void all_blocks(const uint16_t* w, const uint16_t* xp, int64_t m, int64_t x_stride, int64_t npairs, int64_t k_pad,
                const float* bp, c10::BFloat16* yp, int64_t n) {
  at::parallel_for(0, round_up(n, NB) / NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint16_t* wb = w + nb * k_pad * NB;
      const int64_t n0 = nb * NB, n_valid = std::min<int64_t>(NB, n - n0);
      const float* b = bp ? bp + n0 : nullptr;
      for (int64_t r = 0; r < m; r += kMaxRows<NB>) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows<NB>, m - r));
        block_rows_n<NB>(rows, wb, xp + r * x_stride * 2, x_stride, npairs, b, yp + r * n + n0, n, n_valid);
      }
    }
  });
}
#endif

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t block_n) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(weight.is_mkldnn() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "packed_linear: weight must be a bfloat16 [N, K] oneDNN-packed tensor");
  TORCH_CHECK(block_n == 64 || block_n == 32, "packed_linear: block_n must be 64 or 32, not ", block_n);
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "packed_linear: x must be a bfloat16 CPU tensor [M, ", k, "]");
  const int64_t k_pad = round_up(k, kBlockK), n_pad = round_up(n, block_n);
  TORCH_CHECK(mkldnn_nbytes(weight) == n_pad * k_pad * 2, "packed_linear: weight is not in the ", block_n,
              "-output, 32-input blocked layout");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "packed_linear: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  // Pairs of inputs are read as 32-bit words: an odd K or row stride needs a padded copy
  // (the weight's padding is zero, so the extra input is zero too).
  at::Tensor xs = x;
  if (x.stride(1) != 1 || k % 2 != 0 || x.stride(0) % 2 != 0) {
    xs = at::zeros({x.size(0), k + k % 2}, x.options());
    xs.narrow(1, 0, k).copy_(x);
  }
  const int64_t m = xs.size(0), npairs = (k + 1) / 2, x_stride = xs.stride(0) / 2;
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(mkldnn_data_ptr(weight));
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (block_n == 64) {
    all_blocks<64>(w, xp, m, x_stride, npairs, k_pad, bp, yp, n);
  } else {
    all_blocks<32>(w, xp, m, x_stride, npairs, k_pad, bp, yp, n);
  }
  return y;
#else
  (void)x, (void)weight, (void)bias, (void)block_n;
  TORCH_CHECK(false, "packed_linear: this build has no AVX512-BF16 (see build_info())");
#endif
}

PAGEDLLM_FRAGMENT(m) { m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int block_n) -> Tensor"); }

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) { m.impl("packed_linear", &packed_linear); }
