// Matmul of a few rows against a bfloat16 weight in oneDNN's packed layout, for CPU decode
// steps with few requests (batch-1 decode above all).
//
// Registered as torch.ops.pagedllm_cpu_<level>.packed_linear (see __init__.py):
//
//   x [M, K] bfloat16 (last dimension contiguous), weight [N, K] bfloat16 as returned by
//   torch.ops.mkldnn._reorder_linear_weight, bias [N] (bfloat16 / float32) or None,
//   block_n (64 or 32: the layout's outputs per block, see below), amx (use AMX tiles: only
//   with block_n 32, where has_amx() says the CPU and OS allow them)
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
// The AMX path (amx = true; M <= 16): oneDNN picks the 32-output layout where it uses AMX, and
// that layout is the tiles' operand order: for a chunk of 32 inputs (16 pairs), outputs 0-15
// and 16-31 of a block are two 16-row x 64-byte B tiles at a 128-byte row stride, x's rows
// one A tile (M rows x 32 inputs), each block's two accumulators C tiles; tdpbf16ps adds a
// chunk's products to them. Its sums are oneDNN's own (the same instruction over the same
// chunks in the same order: bit-identical to oneDNN's matmul at 1-16 rows on the shapes
// tested) and a row's result does not depend on M. On a 2-core Xeon VM with AMX (one thread,
// process CPU time, alternating in one process, machine loaded; benchmarks/small_m_linear.py,
// docs/benchmarks.md), time relative to vdpbf16ps on the same layout: 0.80-1.03 at 1 row,
// 0.37-0.79 at 5 rows, 0.16-0.42 at 16 rows (shipped model's and 0.5B shape's layers); 0.27-0.96
// of oneDNN's matmul at 1-16 rows (no per-call set-up).
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

// AMX tiles: x86-64 Linux (the OS must grant the tile state: arch_prctl) and a compiler with the
// amx-tile / amx-bf16 targets, at the avx512_bf16 level only (the functions that use them are
// compiled for those targets alone; has_amx() checks the CPU before any runs).
#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
#define PAGEDLLM_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
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
// Lanes [0, valid) of 16 (valid > 0).
PAGEDLLM_INLINE __mmask16 valid_mask(int64_t valid) {
  return valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
}

// Outputs [16 j, 16 j + 16) of a block's bias (zeros without one), lanes outside mask zero.
PAGEDLLM_INLINE __m512 bias_16(const float* bias, int j, __mmask16 mask) {
  return bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
}

// acc + bias rounded to bf16, the lanes in mask stored to y.
PAGEDLLM_INLINE void store_16(__m512 acc, __m512 bias, __mmask16 mask, c10::BFloat16* y) {
  // vcvtneps2bf16 rounds to nearest even, as oneDNN's and PyTorch's float -> bf16.
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, bias)));
}

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
    const __mmask16 mask = valid_mask(valid);
    const __m512 b = bias_16(bias, j, mask);
    for (int r = 0; r < R; ++r) store_16(acc[r][j], b, mask, y + r * y_stride + j * 16);
  }
}
#endif

#if defined(PAGEDLLM_AMX)
// Whether this process may run AMX tile instructions: the CPU has AMX-TILE and AMX-BF16
// (CPUID leaf 7: EDX bits 24 and 22) and Linux grants the tile data state
// (arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18), Linux 5.16+; oneDNN
// asks the same). Asked once.
bool amx_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

// The tile configuration (palette 1): tile 0 = A (rows x 64 bytes), tiles 1, 2 = C
// (rows x 16 floats), tiles 3, 4 = B (16 pairs x 16 outputs x 2 inputs).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Blocks [begin, end) of a 32-output-block weight w (k_pad inputs) against the rows of x
// (bf16, k_pad columns, row stride x_stride bytes), plus bias, into y [rows, n]: this thread's
// share, with its own tile configuration, released at the end.
__attribute__((target("amx-tile,amx-bf16"))) void amx_blocks(const uint16_t* w, const uint16_t* x, int64_t x_stride,
                                                              int rows, int64_t k_pad, const float* bias,
                                                              c10::BFloat16* y, int64_t n, int64_t begin, int64_t end) {
  TileConfig config;
  for (int t = 0; t < 3; ++t) config.rows[t] = static_cast<uint8_t>(rows), config.colsb[t] = 64;
  for (int t = 3; t < 5; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  asm volatile("" ::: "memory");  // the whole configuration written before ldtilecfg reads it
  _tile_loadconfig(&config);
  alignas(64) float c[16 * 32];
  constexpr int64_t kChunk = 32 * kBlockK;  // elements of one 32-input chunk of a block
  for (int64_t nb = begin; nb < end; ++nb) {
    const uint16_t* wb = w + nb * k_pad * 32;
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t kc = 0; kc < k_pad / kBlockK; ++kc) {
      const uint16_t* wc = wb + kc * kChunk;
      for (int line = 0; line < kChunk * 2 / 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(wc + kPrefetchAhead) + 64 * line, _MM_HINT_T0);
      _tile_loadd(0, x + kc * kBlockK, x_stride);
      _tile_loadd(3, wc, 128);
      _tile_loadd(4, wc + 32, 128);
      _tile_dpbf16ps(1, 0, 3);
      _tile_dpbf16ps(2, 0, 4);
    }
    _tile_stored(1, c, 128);
    _tile_stored(2, c + 16, 128);
    const int64_t n0 = nb * 32, n_valid = std::min<int64_t>(32, n - n0);
    for (int j = 0; j < 2 && n_valid > j * 16; ++j) {
      const __mmask16 mask = valid_mask(n_valid - j * 16);
      const __m512 b = bias_16(bias ? bias + n0 : nullptr, j, mask);
      for (int r = 0; r < rows; ++r) store_16(_mm512_load_ps(c + r * 32 + j * 16), b, mask, y + r * n + n0 + j * 16);
    }
  }
  _tile_release();
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

bool has_amx() {
#if defined(PAGEDLLM_AMX)
  return amx_usable();
#else
  return false;
#endif
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t block_n, bool amx) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(weight.is_mkldnn() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "packed_linear: weight must be a bfloat16 [N, K] oneDNN-packed tensor");
  TORCH_CHECK(block_n == 64 || block_n == 32, "packed_linear: block_n must be 64 or 32, not ", block_n);
  TORCH_CHECK(!amx || (block_n == 32 && has_amx()),
              "packed_linear: amx needs block_n 32 and a CPU and OS with AMX tiles (has_amx())");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kBFloat16,
              "packed_linear: x must be a bfloat16 CPU tensor [M, ", k, "]");
  TORCH_CHECK(!amx || x.size(0) <= 16, "packed_linear: amx takes at most 16 rows, not ", x.size(0));
  const int64_t k_pad = round_up(k, kBlockK), n_pad = round_up(n, block_n);
  TORCH_CHECK(mkldnn_nbytes(weight) == n_pad * k_pad * 2, "packed_linear: weight is not in the ", block_n,
              "-output, 32-input blocked layout");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "packed_linear: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  // vdpbf16ps reads pairs of inputs as 32-bit words: an odd K or row stride needs a padded
  // copy; AMX tiles read whole 32-input chunks: K not a multiple of 32 does (the weight's
  // padding is zero, so the extra inputs are zero too).
  at::Tensor xs = x;
  const int64_t k_x = amx ? k_pad : k + k % 2;
  if (x.stride(1) != 1 || k != k_x || (!amx && x.stride(0) % 2 != 0)) {
    xs = at::zeros({x.size(0), k_x}, x.options());
    xs.narrow(1, 0, k).copy_(x);
  }
  const int64_t m = xs.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(mkldnn_data_ptr(weight));
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (amx) {
#if defined(PAGEDLLM_AMX)
    const int64_t x_stride = xs.stride(0) * 2;  // bytes
    at::parallel_for(0, n_pad / 32, 1, [&](int64_t begin, int64_t end) {
      amx_blocks(w, xp, x_stride, static_cast<int>(m), k_pad, bp, yp, n, begin, end);
    });
#endif
    return y;
  }
  const int64_t npairs = (k + 1) / 2, x_stride = xs.stride(0) / 2;
  if (block_n == 64) {
    all_blocks<64>(w, xp, m, x_stride, npairs, k_pad, bp, yp, n);
  } else {
    all_blocks<32>(w, xp, m, x_stride, npairs, k_pad, bp, yp, n);
  }
  return y;
#else
  (void)x, (void)weight, (void)bias, (void)block_n, (void)amx;
  TORCH_CHECK(false, "packed_linear: this build has no AVX512-BF16 (see build_info())");
#endif
}

PAGEDLLM_FRAGMENT(m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int block_n, bool amx=False) -> Tensor");
  m.def("has_amx() -> bool", &has_amx);
}

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) { m.impl("packed_linear", &packed_linear); }
