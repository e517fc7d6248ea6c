// Multi-LoRA delta for CPU: the whole mixed batch of one linear layer in one call.
//
//   lora_sgmv(y, x, lora_a, lora_b, groups, output_sizes)
//
//   y        [T, N] float32 / bfloat16 / float16, updated in place: the base product.
//   x        [T, K] y's dtype: the layer's input.
//   lora_a   [S, K, J * R] float32 or x's dtype: slot s's A^T of each of the J output slices,
//            side by side.
//   lora_b   [S, R, N] lora_a's dtype: slot s's (scaling * B_j)^T, slice j in columns
//            offset_j .. offset_j + N_j (offset_j = N_0 + ... + N_{j-1}).
//   groups   [G, 3] int64: (slot, start, end), runs of tokens start .. end - 1 using slot.
//   output_sizes: N_0 .. N_{J-1}, summing to N.
//
// Per run: shrink xa[t] = x[t] @ lora_a[slot] ([J * R] float32 per token), then expand
// y[t, slice j] += round_to_dtype(xa[t, j*R : (j+1)*R] @ lora_b[slot][:, slice j]): the same
// arithmetic, rounding included, as LoRALinearMethod's PyTorch path (the update is rounded
// to y's dtype before it is added), in one call instead of one matmul per slot and slice.
// This is Punica's SGMV (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving"): tokens
// grouped by adapter into segments, each segment's A and B read once for all its tokens.
//
// A and B in bfloat16 / float16 (the model's dtype) halve the bytes read per step, which is
// what the delta's time is at decode; they are widened exactly to float32 in registers and
// every sum is accumulated in float32 (bfloat16 x and A on AVX-512 BF16: vdpbf16ps, two
// exact products per lane and instruction).
//
// Work split over ATen's thread pool: the shrink by tiles of up to 4 tokens of one run (each
// row of A loaded once for the tile), the expand by (run, block of 256 output columns).
// Vector path (AVX-512 and AVX2 builds; simd.h): tokens x vectors of accumulators in
// registers over contiguous rows of A and B, y widened and rounded 16 or 8 lanes at a time;
// tails and portable builds use the scalar loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kColumnBlock = 256;  // output columns per expand work item

#ifdef PAGEDLLM_VEC
using namespace pagedllm_simd;
constexpr int64_t W = kVecWidth;
#endif

struct Run {
  int64_t slot, start, end;
};

constexpr int kTokenTile = 4;  // tokens of one run whose shrink shares each load of A
#if defined(__AVX512F__)
constexpr int kMaxVectors = 4;  // accumulator vectors per token: kTokenTile * 4 of 32 registers
#else
constexpr int kMaxVectors = 2;  // kTokenTile * 2 of 16 registers
#endif

#ifdef PAGEDLLM_VEC
#if defined(__AVX512BF16__)
// Rows k and k + 1 of 16 bfloat16 columns -> 16 pairs (a[k][c], a[k + 1][c]): vdpbf16ps's operand.
inline __m512i bf16_pairs(const c10::BFloat16* row0, const c10::BFloat16* row1) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                       20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1)), 1);
  return _mm512_permutexvar_epi16(idx, both);
}
#endif

// acc[t * ldacc + 0 .. NV * W) = sum_k x[t * ldx + k] * a[k * lda + 0 .. NV * W) for t < NT:
// NT * NV accumulators in registers, each row of A loaded (and widened) once for NT tokens.
// bfloat16 x and A on AVX-512 BF16: two k at a time with vdpbf16ps (products exact in float32).
template <int NT, int NV, typename T, typename WT>
inline void shrink_tile(float* acc, int64_t ldacc, const T* x, int64_t ldx, const WT* a, int64_t K, int64_t lda) {
  VecF s[NT][NV];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) s[t][v] = vset1(0.f);
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<WT, c10::BFloat16>) {
    for (; k + 2 <= K; k += 2) {
      __m512i pairs[NV];
      for (int v = 0; v < NV; ++v) pairs[v] = bf16_pairs(a + k * lda + v * W, a + (k + 1) * lda + v * W);
      for (int t = 0; t < NT; ++t) {
        int32_t xk;
        std::memcpy(&xk, x + t * ldx + k, sizeof(xk));
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xk));
        for (int v = 0; v < NV; ++v) s[t][v].v = _mm512_dpbf16_ps(s[t][v].v, reinterpret_cast<__m512bh>(pairs[v]), xb);
      }
    }
  }
#endif
  for (; k < K; ++k) {
    VecF row[NV];
    for (int v = 0; v < NV; ++v) row[v] = vload(a + k * lda + v * W);
    for (int t = 0; t < NT; ++t) {
      const VecF xk = vset1(static_cast<float>(x[t * ldx + k]));
      for (int v = 0; v < NV; ++v) s[t][v] = vfmadd(xk, row[v], s[t][v]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) vstore(acc + t * ldacc + v * W, s[t][v]);
}

template <int NT, typename T, typename WT>
inline int64_t shrink_columns(float* acc, int64_t ldacc, const T* x, int64_t ldx, const WT* a, int64_t K, int64_t lda,
                              int64_t c, int64_t n) {
  while (c + W <= n) {
    switch (std::min<int64_t>(kMaxVectors, (n - c) / W)) {
#if defined(__AVX512F__)
      case 4: shrink_tile<NT, 4>(acc + c, ldacc, x, ldx, a + c, K, lda); c += 4 * W; break;
      case 3: shrink_tile<NT, 3>(acc + c, ldacc, x, ldx, a + c, K, lda); c += 3 * W; break;
#endif
      case 2: shrink_tile<NT, 2>(acc + c, ldacc, x, ldx, a + c, K, lda); c += 2 * W; break;
      default: shrink_tile<NT, 1>(acc + c, ldacc, x, ldx, a + c, K, lda); c += W; break;
    }
  }
  return c;
}
#endif

// acc[t * ldacc + 0 .. n) = sum_k x[t * ldx + k] * a[k * lda + 0 .. n) for t < nt (at most
// kTokenTile): the shrink of a few tokens of one run.
template <typename T, typename WT>
inline void shrink_rows(float* acc, int64_t ldacc, const T* x, int64_t ldx, int nt, const WT* a, int64_t K,
                        int64_t lda, int64_t n) {
  int64_t c = 0;
#ifdef PAGEDLLM_VEC
  switch (nt) {
    case 4: c = shrink_columns<4>(acc, ldacc, x, ldx, a, K, lda, c, n); break;
    case 3: c = shrink_columns<3>(acc, ldacc, x, ldx, a, K, lda, c, n); break;
    case 2: c = shrink_columns<2>(acc, ldacc, x, ldx, a, K, lda, c, n); break;
    default: c = shrink_columns<1>(acc, ldacc, x, ldx, a, K, lda, c, n); break;
  }
#endif
  for (int t = 0; t < nt; ++t) {
    for (int64_t j = c; j < n; ++j) {
      float s0 = 0.f;
      for (int64_t k = 0; k < K; ++k) s0 += static_cast<float>(x[t * ldx + k]) * static_cast<float>(a[k * lda + j]);
      acc[t * ldacc + j] = s0;
    }
  }
}

// y[0 .. width) = to_T(y + to_T(sum_r coef[r] * b[r * ldb + 0 .. width))): one token's expand.
template <typename T, typename WT>
inline void expand_row(T* y, const float* coef, const WT* b, int64_t R, int64_t ldb, int64_t width) {
  int64_t c = 0;
#ifdef PAGEDLLM_VEC
  for (; c + 4 * W <= width; c += 4 * W) {
    VecF s0 = vset1(0.f), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t r = 0; r < R; ++r) {
      const VecF cr = vset1(coef[r]);
      const WT* row = b + r * ldb + c;
      s0 = vfmadd(cr, vload(row), s0);
      s1 = vfmadd(cr, vload(row + W), s1);
      s2 = vfmadd(cr, vload(row + 2 * W), s2);
      s3 = vfmadd(cr, vload(row + 3 * W), s3);
    }
    vstore(y + c, vload(y + c) + vround<T>(s0));
    vstore(y + c + W, vload(y + c + W) + vround<T>(s1));
    vstore(y + c + 2 * W, vload(y + c + 2 * W) + vround<T>(s2));
    vstore(y + c + 3 * W, vload(y + c + 3 * W) + vround<T>(s3));
  }
  for (; c + W <= width; c += W) {
    VecF s0 = vset1(0.f);
    for (int64_t r = 0; r < R; ++r) s0 = vfmadd(vset1(coef[r]), vload(b + r * ldb + c), s0);
    vstore(y + c, vload(y + c) + vround<T>(s0));
  }
#endif
  for (; c < width; ++c) {
    float s0 = 0.f;
    for (int64_t r = 0; r < R; ++r) s0 += coef[r] * static_cast<float>(b[r * ldb + c]);
    y[c] = static_cast<T>(static_cast<float>(y[c]) + static_cast<float>(static_cast<T>(s0)));
  }
}

// Work items: tiles of up to kTokenTile tokens of one run (tile_run: run index << 32 | first
// token's offset in the run).
template <typename T, typename WT>
void shrink(float* xa, const T* x, const WT* a, const std::vector<Run>& runs, const std::vector<int64_t>& tile_run,
            int64_t K, int64_t JR) {
  at::parallel_for(0, static_cast<int64_t>(tile_run.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[tile_run[i] >> 32];
      const int64_t t = run.start + (tile_run[i] & 0xffffffff);
      const int nt = static_cast<int>(std::min<int64_t>(kTokenTile, run.end - t));
      shrink_rows(xa + t * JR, JR, x + t * K, K, nt, a + run.slot * K * JR, K, JR, JR);
    }
  });
}

// Work items: (run, block of columns); within one, the block's rows of B stay in L1 for
// every token of the run.
template <typename T, typename WT>
void expand(T* y, const float* xa, const WT* b, const std::vector<Run>& runs,
            const std::vector<int64_t>& column_blocks, const std::vector<int64_t>& block_slice,
            int64_t N, int64_t R, int64_t JR) {
  const int64_t num_blocks = static_cast<int64_t>(column_blocks.size()) - 1;
  const int64_t items = static_cast<int64_t>(runs.size()) * num_blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Run& run = runs[item / num_blocks];
      const int64_t blk = item % num_blocks;
      const int64_t c0 = column_blocks[blk];
      const WT* bs = b + run.slot * R * N + c0;
      for (int64_t t = run.start; t < run.end; ++t) {
        expand_row(y + t * N + c0, xa + t * JR + block_slice[blk] * R, bs, R, N, column_blocks[blk + 1] - c0);
      }
    }
  });
}

template <typename T, typename WT>
void shrink_expand(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                   const std::vector<Run>& runs, const std::vector<int64_t>& tile_run,
                   const std::vector<int64_t>& column_blocks, const std::vector<int64_t>& block_slice, int64_t R) {
  const int64_t K = x.size(1), N = y.size(1), JR = lora_a.size(2);
  std::vector<float> xa(static_cast<size_t>(x.size(0) * JR));
  shrink(xa.data(), x.data_ptr<T>(), lora_a.data_ptr<WT>(), runs, tile_run, K, JR);
  expand(y.data_ptr<T>(), xa.data(), lora_b.data_ptr<WT>(), runs, column_blocks, block_slice, N, R, JR);
}

// A and B in float32, or in x's dtype (the model's: bfloat16 / float16 halve the bytes read).
template <typename T>
void dispatch_weights(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                      const std::vector<Run>& runs, const std::vector<int64_t>& tile_run,
                      const std::vector<int64_t>& column_blocks, const std::vector<int64_t>& block_slice, int64_t R) {
  if (lora_a.scalar_type() == at::kFloat) {
    shrink_expand<T, float>(y, x, lora_a, lora_b, runs, tile_run, column_blocks, block_slice, R);
  } else {
    if constexpr (!std::is_same_v<T, float>) {
      shrink_expand<T, T>(y, x, lora_a, lora_b, runs, tile_run, column_blocks, block_slice, R);
    }
  }
}

void lora_sgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& groups, at::IntArrayRef output_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_sgmv: x [T, K] and y [T, N]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_sgmv: x, y, lora_a and lora_b must be contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_sgmv: x and y must have one dtype");
  TORCH_CHECK(lora_a.scalar_type() == lora_b.scalar_type() &&
                  (lora_a.scalar_type() == at::kFloat || lora_a.scalar_type() == x.scalar_type()),
              "lora_sgmv: lora_a and lora_b must both be float32 or both x's dtype");
  const int64_t K = x.size(1), N = y.size(1);
  const int64_t J = static_cast<int64_t>(output_sizes.size());
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.size(1) == K && J > 0 && lora_a.size(2) % J == 0,
              "lora_sgmv: lora_a must be [S, K, J * R]");
  const int64_t S = lora_a.size(0), JR = lora_a.size(2), R = JR / J;
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.size(0) == S && lora_b.size(1) == R && lora_b.size(2) == N,
              "lora_sgmv: lora_b must be [S, R, N]");
  TORCH_CHECK(groups.dim() == 2 && groups.size(1) == 3 && groups.scalar_type() == at::kLong && groups.is_contiguous(),
              "lora_sgmv: groups must be [G, 3] int64");

  // Output slices cut into blocks of at most kColumnBlock columns, none straddling two slices.
  std::vector<int64_t> column_blocks{0}, block_slice;
  int64_t offset = 0;
  for (int64_t j = 0; j < J; ++j) {
    const int64_t slice_end = offset + output_sizes[j];
    for (int64_t c = offset; c < slice_end; c += kColumnBlock) {
      column_blocks.push_back(std::min(c + kColumnBlock, slice_end));
      block_slice.push_back(j);
    }
    offset = slice_end;
  }
  TORCH_CHECK(offset == N, "lora_sgmv: output_sizes must sum to y's width");

  const int64_t* g = groups.data_ptr<int64_t>();
  std::vector<Run> runs;
  std::vector<int64_t> tile_run;  // (run index << 32) | first token's offset within the run
  for (int64_t i = 0; i < groups.size(0); ++i) {
    const Run run{g[3 * i], g[3 * i + 1], g[3 * i + 2]};
    TORCH_CHECK(run.slot >= 0 && run.slot < S && run.start >= 0 && run.start <= run.end && run.end <= x.size(0),
                "lora_sgmv: group ", i, " (slot ", run.slot, ", tokens ", run.start, "..", run.end,
                ") is out of range");
    if (run.start == run.end) continue;
    for (int64_t t = 0; t < run.end - run.start; t += kTokenTile) {
      tile_run.push_back((static_cast<int64_t>(runs.size()) << 32) | t);
    }
    runs.push_back(run);
  }
  if (runs.empty()) return;

  switch (x.scalar_type()) {
    case at::kFloat:
      dispatch_weights<float>(y, x, lora_a, lora_b, runs, tile_run, column_blocks, block_slice, R);
      break;
    case at::kBFloat16:
      dispatch_weights<c10::BFloat16>(y, x, lora_a, lora_b, runs, tile_run, column_blocks, block_slice, R);
      break;
    case at::kHalf:
      dispatch_weights<c10::Half>(y, x, lora_a, lora_b, runs, tile_run, column_blocks, block_slice, R);
      break;
    default:
      TORCH_CHECK(false, "lora_sgmv: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("lora_sgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor groups, int[] output_sizes) -> ()");
}

PAGEDLLM_IMPL(CPU, m) { m.impl("lora_sgmv", &lora_sgmv); }
