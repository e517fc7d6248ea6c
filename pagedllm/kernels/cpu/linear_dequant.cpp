// Matmul of many rows (prefill, large decode batches) against 8- and 4-bit weights: the
// weights are dequantized tile by tile into a small buffer of the GEMM's dtype and each tile
// goes through torch's GEMM, so a quantized layer runs at the speed of a 16-bit one while its
// weights stay quantized in memory.
//
// Registered as torch.ops.pagedllm_cpu_<level>.linear_dequant (see __init__.py):
//
//   linear_dequant(x [M, K] float32 / bfloat16 / float16 (last dimension contiguous),
//                  weight, scale, zero or None, bias [N] or None, N, bits, tile_cols)
//     ->  y = x W^T + b, [M, N] in x's dtype
//
// for the weights of linear_w16.cpp / linear_grouped.cpp, in their blocks of 16 outputs:
//
//   weight int8 [N / 16, K, 16] (pack_w8), scale [N], zero None, bits 8:  W = scale[n] * Q
//   weight float8_e4m3fn, same layout and scale, bits 8:                   W = scale[n] * F
//   weight uint8 [N / 16, K, 16] (pack_w8), scale / zero [N, G], bits 8:  W = scale * (Q - zero)
//   weight uint8 [N / 16, K / 2, 16] (pack_w4), scale / zero [N, G], bits 4: the same per group
//
// (grouped: scale float32 or float16, zero None for symmetric weights, both [N, G] or blocked
// [ceil(N / 16), G, 16]; group_scales.h)
//
// The GEMM's dtype: bfloat16 when x is bfloat16 in an AVX512-BF16 build (torch's bfloat16 GEMM
// is oneDNN's, with AMX where the CPU has it, the path of an unquantized bf16 layer); float32
// elsewhere (without native bfloat16, torch's float32 GEMM is ~5x its bfloat16 one; see
// linear_w16.cpp). Dequantization is in float32 ((Q - zero) * scale, as the formats define
// it), rounded once to the GEMM's dtype.
//
// Tiles: the N outputs are cut into tiles of tile_cols (a multiple of 16; 0 picks the width
// whose dequantized K x tile_cols weights fill kTileBytes, about half of a core's L2); the
// threads share the tiles out, and each dequantizes its tile into a [K, tile_cols] buffer of
// its own and multiplies it at once, single-threaded, into y's columns, while the tile is hot
// in L2. No dequantized copy of a whole layer is ever made.
//
// One more weight takes another road, int8 activations instead of dequantized weights:
//
//   weight int8 in oneDNN's packed layout (torch.ops.onednn.qlinear_prepack of Q [N, K], an
//   opaque mkldnn tensor of shape [K, N]), scale [N], zero None, bits 8:                  W = scale[n] * Q
//
// Each row of x is quantized to int8 with one float32 scale (dynamic per-token symmetric
// quantization, as vLLM's W8A8 int8 layers do: s = max_k |x_k| / 127, a_k = round_half_even(x_k
// / s), s = 1 for an all-zero row), oneDNN's int8 GEMM (torch.ops.onednn.qlinear_pointwise:
// AMX-INT8 or VNNI brgemm on the prepacked weight, no per-call reorder) sums a_k Q[n, k] exactly
// in int32 and scales by scale[n] into float32, and the row's s (and the bias) is applied in
// float32 before the one rounding to x's dtype. Half the weight bytes of bf16 and twice its
// multiply rate; oneDNN's int8 GEMM is exact only with VNNI or AMX (below, int16 pairs
// saturate), so the Python side packs weights this way only at the avx512_bf16 level.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "group_scales.h"
#include "simd.h"
#include "weight_blocks.h"

namespace {

using pagedllm_blocks::kBlock;
using pagedllm_groups::Groups;

constexpr int64_t kTileBytes = 512 << 10;  // dequantized weights per tile (automatic width)

// The four weight formats; Format::kBits is the stored width.
enum class Format { kInt8Channel, kFp8Channel, kUint8Group, kUint4Group };

// 16 stored weights of one input (block layout) -> float32 values before scaling.
template <Format F>
inline void load16(const uint8_t* block, int64_t i, float* out) {
  if constexpr (F == Format::kUint4Group) {
    const uint8_t* p = block + (i / 2) * kBlock;
    const int shift = (i % 2) * 4;
    for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>((p[j] >> shift) & 0x0F);
  } else {
    const uint8_t* p = block + i * kBlock;
    for (int j = 0; j < kBlock; ++j) {
      if constexpr (F == Format::kInt8Channel) {
        out[j] = static_cast<float>(static_cast<int8_t>(p[j]));
      } else if constexpr (F == Format::kFp8Channel) {
        out[j] = static_cast<float>(c10::Float8_e4m3fn(p[j], c10::Float8_e4m3fn::from_bits()));
      } else {
        out[j] = static_cast<float>(p[j]);
      }
    }
  }
}

#ifdef PAGEDLLM_VEC
using pagedllm_simd::kVecWidth;
using pagedllm_simd::VecF;

// kVecWidth unsigned / signed bytes -> float32 lanes, exactly.
inline VecF widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
#endif
}
inline VecF widen_i8(const uint8_t* p) {
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
#endif
}

// Lanes [h, h + kVecWidth) of input i's 16 weights, before scaling.
template <Format F>
inline VecF load_vec(const uint8_t* block, int64_t i, int h) {
  if constexpr (F == Format::kUint4Group) {
    alignas(16) uint8_t nibbles[kBlock];
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (i / 2) * kBlock));
    const __m128i shifted = (i % 2) ? _mm_srli_epi16(bytes, 4) : bytes;
    _mm_store_si128(reinterpret_cast<__m128i*>(nibbles), _mm_and_si128(shifted, _mm_set1_epi8(0x0F)));
    return widen_u8(nibbles + h);
  } else if constexpr (F == Format::kInt8Channel) {
    return widen_i8(block + i * kBlock + h);
  } else if constexpr (F == Format::kFp8Channel) {
    return pagedllm_simd::vload(reinterpret_cast<const c10::Float8_e4m3fn*>(block + i * kBlock + h));
  } else {
    return widen_u8(block + i * kBlock + h);
  }
}
#endif

// Dequantize blocks [b0, b0 + nblocks) into buf [K, ld] (row k: the tile's outputs in order);
// gs: scales per output ([N], groups 1, zero 0) or per output and group ([N, groups]).
template <Format F, typename T>
void dequant_tile(const uint8_t* wp, int64_t k, int64_t n, const Groups& gs, int64_t b0, int64_t nblocks, T* buf,
                  int64_t ld) {
  constexpr bool grouped = F == Format::kUint8Group || F == Format::kUint4Group;
  constexpr int64_t bytes_per_input = F == Format::kUint4Group ? kBlock / 2 : kBlock;
  const int64_t groups = gs.groups, group_size = k / groups;
  for (int64_t b = b0; b < b0 + nblocks; ++b) {
    const uint8_t* block = wp + b * k * bytes_per_input;
    const int64_t n_valid = std::min(kBlock, n - b * kBlock);
    T* col = buf + (b - b0) * kBlock;
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float s[kBlock] = {}, z[kBlock] = {};  // padding outputs: scale 0
      for (int64_t j = 0; j < n_valid; ++j) {
        s[j] = gs.scale(b * kBlock + j, g);
        z[j] = gs.zero_at(b * kBlock + j, g);
      }
      int64_t i = g * group_size;
      const int64_t end = (g + 1) * group_size;
#ifdef PAGEDLLM_VEC
      VecF sv[kBlock / kVecWidth], zv[kBlock / kVecWidth];
      for (int h = 0; h < kBlock; h += kVecWidth) {
        sv[h / kVecWidth] = pagedllm_simd::vload(s + h);
        zv[h / kVecWidth] = pagedllm_simd::vload(z + h);
      }
      for (; i < end; ++i) {
        for (int h = 0; h < kBlock; h += kVecWidth) {
          const VecF q = load_vec<F>(block, i, h);
          const VecF w = grouped ? (q - zv[h / kVecWidth]) * sv[h / kVecWidth] : q * sv[h / kVecWidth];
          pagedllm_simd::vstore(col + i * ld + h, w);
        }
      }
#endif
      for (; i < end; ++i) {
        float q[kBlock];
        load16<F>(block, i, q);
        for (int j = 0; j < kBlock; ++j) col[i * ld + j] = static_cast<T>((q[j] - z[j]) * s[j]);
      }
    }
  }
}

template <Format F, typename T>
void tiled_gemm(const at::Tensor& xc, const at::Tensor& packed, const Groups& gs, const at::Tensor& bias_c, int64_t n,
                int64_t tile_cols, at::Tensor& y) {
  const int64_t k = xc.size(1), nb = packed.size(0), tile_blocks = tile_cols / kBlock;
  const uint8_t* wp = static_cast<const uint8_t*>(packed.const_data_ptr());
  const int64_t tiles = (nb + tile_blocks - 1) / tile_blocks;
  // The caller's thread-local state (InferenceMode above all: y is an inference tensor under
  // it, and the workers write into it with ATen ops) holds in the worker threads too.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor buf = at::empty({k, tile_cols}, xc.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * tile_blocks, nblocks = std::min(tile_blocks, nb - b0);
      const int64_t c0 = b0 * kBlock, cols = std::min(nblocks * kBlock, n - c0);
      dequant_tile<F, T>(wp, k, n, gs, b0, nblocks, buf.mutable_data_ptr<T>(), tile_cols);
      at::Tensor out = y.narrow(1, c0, cols);
      const at::Tensor w = buf.narrow(1, 0, cols);
      if (bias_c.defined()) {
        at::addmm_out(out, bias_c.narrow(0, c0, cols).unsqueeze(0).expand({xc.size(0), cols}), xc, w);
      } else {
        at::mm_out(out, xc, w);
      }
    }
  });
}

// Row r of x (k values of T) -> a [k] int8 and its scale (see the header comment).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* a, float* scale) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef PAGEDLLM_VEC
  VecF peak = pagedllm_simd::vset1(0.f);
  for (; i + kVecWidth <= k; i += kVecWidth) {
    const VecF v = pagedllm_simd::vload(x + i);
    peak = pagedllm_simd::vmax(peak, pagedllm_simd::vmax(v, pagedllm_simd::vset1(0.f) - v));
  }
  amax = pagedllm_simd::vreduce_max(peak);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  *scale = s;
  i = 0;
#ifdef PAGEDLLM_VEC
  const VecF sv = pagedllm_simd::vset1(s);
  for (; i + kVecWidth <= k; i += kVecWidth) {
    const VecF r = pagedllm_simd::vround_nearest(pagedllm_simd::vload(x + i) / sv);
#if defined(__AVX512F__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + i), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r.v)));
#else
    alignas(32) float rounded[kVecWidth];
    pagedllm_simd::vstore(rounded, r);
    for (int j = 0; j < kVecWidth; ++j) a[i + j] = static_cast<int8_t>(rounded[j]);
#endif
  }
#endif
  for (; i < k; ++i) a[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) / s));
}

// y[r, :] = acc[r, :] * s[r] + bias, rounded once to T.
template <typename T>
void scale_row(const float* acc, float s, const float* bias, int64_t n, T* y) {
  int64_t j = 0;
#ifdef PAGEDLLM_VEC
  const VecF sv = pagedllm_simd::vset1(s);
  for (; j + kVecWidth <= n; j += kVecWidth) {
    const VecF b = bias ? pagedllm_simd::vload(bias + j) : pagedllm_simd::vset1(0.f);
    pagedllm_simd::vstore(y + j, pagedllm_simd::vfmadd(pagedllm_simd::vload(acc + j), sv, b));
  }
#endif
  for (; j < n; ++j) y[j] = static_cast<T>(std::fma(acc[j], s, bias ? bias[j] : 0.f));
}

// Rows per oneDNN int8 call: bounds its float32 output (at most 256 x N x 4 bytes, which the
// allocator then reuses from call to call instead of mapping fresh pages): the 0.5B shape's
// gate_up at 2048 rows took 71 ms in one call, 34 ms in chunks of 256 (one thread).
constexpr int64_t kInt8RowChunk = 256;

// oneDNN's int8 linear on a qlinear_prepack'ed weight: (x_q Q^T) * scale[n], float32 [M, N]
// (called boxed: no C++ signature of torch's kernel to match).
at::Tensor onednn_int8_linear(const at::Tensor& xq, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& zero_points) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  std::vector<c10::IValue> stack{xq, 1.0, int64_t{0}, packed, scale, zero_points, c10::IValue(), 1.0, int64_t{0},
                                 c10::IValue(at::kFloat), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

template <typename T>
at::Tensor int8_activation_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                const at::Tensor& bias_f, int64_t n) {
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor xq = at::empty({m, k}, xc.options().dtype(at::kChar));
  at::Tensor row_scale = at::empty({m}, xc.options().dtype(at::kFloat));
  const T* xp = xc.const_data_ptr<T>();
  int8_t* qp = xq.mutable_data_ptr<int8_t>();
  float* sp = row_scale.mutable_data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row<T>(xp + r * k, k, qp + r * k, sp + r);
  });
  const at::Tensor zero_points = at::zeros({n}, scale.options().dtype(at::kLong));
  at::Tensor y = at::empty({m, n}, xc.options());
  const float* bp = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  T* yp = y.mutable_data_ptr<T>();
  for (int64_t r0 = 0; r0 < m; r0 += kInt8RowChunk) {
    const int64_t rows = std::min(kInt8RowChunk, m - r0);
    const at::Tensor acc = onednn_int8_linear(xq.narrow(0, r0, rows), packed, scale, zero_points);
    const float* ap = acc.const_data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) scale_row<T>(ap + r * n, sp[r0 + r], bp, n, yp + (r0 + r) * n);
    });
  }
  return y;
}

// The oneDNN-packed int8 weight's road (see the header comment).
at::Tensor linear_int8_activations(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                   const at::Tensor& zero, const std::optional<at::Tensor>& bias, int64_t n,
                                   int64_t bits) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.size(1) == n && bits == 8 &&
                  !zero.defined(),
              "linear_dequant: a oneDNN-packed weight must be int8 [K, N] from onednn::qlinear_prepack with "
              "per-output scales, zero None and bits 8 (N = ", n, ")");
  const int64_t k = packed.size(0);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 1 && scale.size(0) == n,
              "linear_dequant: scale must be a contiguous float32 CPU tensor [N] (N = ", n, ")");
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "linear_dequant: x must be a float32 / bfloat16 / float16 CPU tensor [M, ", k, "]");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_dequant: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  switch (xt) {
    case at::kFloat: return int8_activation_gemm<float>(x, packed, scale, bias_f, n);
    case at::kBFloat16: return int8_activation_gemm<c10::BFloat16>(x, packed, scale, bias_f, n);
    default: return int8_activation_gemm<c10::Half>(x, packed, scale, bias_f, n);
  }
}

at::Tensor linear_dequant(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const std::optional<at::Tensor>& zero_opt, const std::optional<at::Tensor>& bias, int64_t n,
                          int64_t bits, int64_t tile_cols) {
  const at::Tensor zero = zero_opt.has_value() ? *zero_opt : at::Tensor();
  if (packed.is_mkldnn()) return linear_int8_activations(x, packed, scale, zero, bias, n, bits);
  const auto wt = packed.scalar_type();
  const bool grouped = wt == at::kByte;  // uint8: grouped 4 / 8 bits; int8 / float8: per output
  TORCH_CHECK(bits == 4 || bits == 8, "linear_dequant: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous(),
              "linear_dequant: weight must be a CPU tensor in blocks of 16 outputs (pack_w8 / pack_w4)");
  TORCH_CHECK(grouped || (bits == 8 && (wt == at::kChar || wt == at::kFloat8_e4m3fn) && !zero.defined()),
              "linear_dequant: weight must be uint8 (grouped 4 / 8 bits), or int8 / float8_e4m3fn with per-output "
              "scales and no zero (8 bits); got ", wt, " with", zero.defined() ? "" : "out", " zero, bits ", bits);
  const int64_t k = bits == 4 ? packed.size(1) * 2 : packed.size(1);
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlock && n <= packed.size(0) * kBlock, "linear_dequant: N = ", n,
              " does not match the packed weight's ", packed.size(0), " blocks of 16 outputs");
  at::Tensor scale_holder;
  Groups gs;
  if (grouped) {
    gs = pagedllm_groups::view_groups("linear_dequant", scale, zero, n, bits, scale_holder);
    TORCH_CHECK(k % gs.groups == 0, "linear_dequant: scale's ", gs.groups, " groups must divide K = ", k);
    TORCH_CHECK(bits != 4 || (k / gs.groups) % 2 == 0, "linear_dequant: 4-bit groups must have an even size");
  } else {
    TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                    scale.dim() == 1 && scale.size(0) == n,
                "linear_dequant: scale must be a contiguous float32 CPU tensor [N] (N = ", n, ", K = ", k, ")");
    gs.scale32 = scale.const_data_ptr<float>();  // one group per output, zero 0
  }
  TORCH_CHECK(tile_cols >= 0 && tile_cols % kBlock == 0, "linear_dequant: tile_cols must be 0 or a multiple of 16, got ",
              tile_cols);
  const auto xt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k &&
                  (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              "linear_dequant: x must be a float32 / bfloat16 / float16 CPU tensor [M, ", k, "]");
#if defined(__AVX512BF16__)
  const auto ct = xt == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
#else
  const auto ct = at::kFloat;
#endif
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_dequant: bias must be [", n, "]");
    bias_c = bias->to(ct).contiguous();
  }
  const int64_t elt = ct == at::kFloat ? 4 : 2;
  if (tile_cols == 0) {  // kTileBytes wide at most, as many tiles per thread as can be
    const int64_t nb = packed.size(0), threads = at::get_num_threads();
    const int64_t widest = std::clamp<int64_t>(kTileBytes / (elt * std::max<int64_t>(k, 1)) / kBlock, 1, nb);
    const int64_t tiles = ((nb + widest - 1) / widest + threads - 1) / threads * threads;
    tile_cols = std::max<int64_t>(1, (nb + tiles - 1) / tiles) * kBlock;
  }
  const at::Tensor xc = x.to(ct).contiguous();
  at::Tensor y = at::empty({x.size(0), n}, xc.options());
  const Format f = !grouped ? (wt == at::kChar ? Format::kInt8Channel : Format::kFp8Channel)
                            : (bits == 4 ? Format::kUint4Group : Format::kUint8Group);
#define PAGEDLLM_TILED(T)                                                                                       \
  switch (f) {                                                                                                  \
    case Format::kInt8Channel: tiled_gemm<Format::kInt8Channel, T>(xc, packed, gs, bias_c, n, tile_cols, y); break; \
    case Format::kFp8Channel: tiled_gemm<Format::kFp8Channel, T>(xc, packed, gs, bias_c, n, tile_cols, y); break;   \
    case Format::kUint8Group: tiled_gemm<Format::kUint8Group, T>(xc, packed, gs, bias_c, n, tile_cols, y); break;   \
    case Format::kUint4Group: tiled_gemm<Format::kUint4Group, T>(xc, packed, gs, bias_c, n, tile_cols, y); break;   \
  }
  if (ct == at::kFloat) {
    PAGEDLLM_TILED(float)
  } else {
    PAGEDLLM_TILED(c10::BFloat16)
  }
#undef PAGEDLLM_TILED
  return y.scalar_type() == xt ? y : y.to(xt);
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("linear_dequant(Tensor x, Tensor weight, Tensor scale, Tensor? zero, Tensor? bias, int n, int bits, "
        "int tile_cols=0) -> Tensor");
}

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) { m.impl("linear_dequant", &linear_dequant); }
