// Multi-LoRA delta for CPU: the whole mixed batch of one linear layer in one call.
//
//   lora_sgmv(y, x, lora_a, lora_b, groups, output_sizes)
//
//   y        [T, N] float32 / bfloat16 / float16, updated in place: the base product.
//   x        [T, K] y's dtype: the layer's input.
//   lora_a   [S, K, J * R] float32: slot s's A^T of each of the J output slices, side by side.
//   lora_b   [S, R, N] float32: slot s's (scaling * B_j)^T, slice j in columns
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
// Work split over ATen's thread pool: the shrink by token, the expand by (run, block of 256
// output columns). Vector path (AVX-512 and AVX2 builds; simd.h): up to four vectors of
// accumulators in registers over contiguous float32 rows of A and B, y widened and rounded
// 16 or 8 lanes at a time; tails and portable builds use the scalar loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cstdint>
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

#ifdef PAGEDLLM_VEC
// acc[0 .. NV * W) = sum_k x[k] * a[k * lda + 0 .. NV * W), NV accumulators in registers.
template <int NV, typename T>
inline void shrink_vectors(float* acc, const T* x, const float* a, int64_t K, int64_t lda) {
  VecF s[NV];
  for (int v = 0; v < NV; ++v) s[v] = vset1(0.f);
  for (int64_t k = 0; k < K; ++k) {
    const VecF xk = vset1(static_cast<float>(x[k]));
    const float* row = a + k * lda;
    for (int v = 0; v < NV; ++v) s[v] = vfmadd(xk, vload(row + v * W), s[v]);
  }
  for (int v = 0; v < NV; ++v) vstore(acc + v * W, s[v]);
}
#endif

// acc[0 .. n) = sum_k x[k] * a[k * lda + 0 .. n): one token's shrink, up to four vectors of
// columns per pass over x.
template <typename T>
inline void shrink_row(float* acc, const T* x, const float* a, int64_t K, int64_t lda, int64_t n) {
  int64_t c = 0;
#ifdef PAGEDLLM_VEC
  for (; c + W <= n;) {
    switch (std::min<int64_t>(4, (n - c) / W)) {
      case 4: shrink_vectors<4>(acc + c, x, a + c, K, lda); c += 4 * W; break;
      case 3: shrink_vectors<3>(acc + c, x, a + c, K, lda); c += 3 * W; break;
      case 2: shrink_vectors<2>(acc + c, x, a + c, K, lda); c += 2 * W; break;
      default: shrink_vectors<1>(acc + c, x, a + c, K, lda); c += W; break;
    }
  }
#endif
  for (; c < n; ++c) {
    float s0 = 0.f;
    for (int64_t k = 0; k < K; ++k) s0 += static_cast<float>(x[k]) * a[k * lda + c];
    acc[c] = s0;
  }
}

// y[0 .. width) = to_T(y + to_T(sum_r coef[r] * b[r * ldb + 0 .. width))): one token's expand.
template <typename T>
inline void expand_row(T* y, const float* coef, const float* b, int64_t R, int64_t ldb, int64_t width) {
  int64_t c = 0;
#ifdef PAGEDLLM_VEC
  for (; c + 4 * W <= width; c += 4 * W) {
    VecF s0 = vset1(0.f), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t r = 0; r < R; ++r) {
      const VecF cr = vset1(coef[r]);
      const float* row = b + r * ldb + c;
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
    for (int64_t r = 0; r < R; ++r) s0 += coef[r] * b[r * ldb + c];
    y[c] = static_cast<T>(static_cast<float>(y[c]) + static_cast<float>(static_cast<T>(s0)));
  }
}

template <typename T>
void shrink(float* xa, const T* x, const float* a, const std::vector<Run>& runs,
            const std::vector<int64_t>& token_run, int64_t K, int64_t JR) {
  at::parallel_for(0, static_cast<int64_t>(token_run.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[token_run[i] >> 32];
      const int64_t t = run.start + (token_run[i] & 0xffffffff);
      shrink_row(xa + t * JR, x + t * K, a + run.slot * K * JR, K, JR, JR);
    }
  });
}

// Work items: (run, block of columns); within one, the block's rows of B stay in L1 for
// every token of the run.
template <typename T>
void expand(T* y, const float* xa, const float* b, const std::vector<Run>& runs,
            const std::vector<int64_t>& column_blocks, const std::vector<int64_t>& block_slice,
            int64_t N, int64_t R, int64_t JR) {
  const int64_t num_blocks = static_cast<int64_t>(column_blocks.size()) - 1;
  const int64_t items = static_cast<int64_t>(runs.size()) * num_blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Run& run = runs[item / num_blocks];
      const int64_t blk = item % num_blocks;
      const int64_t c0 = column_blocks[blk];
      const float* bs = b + run.slot * R * N + c0;
      for (int64_t t = run.start; t < run.end; ++t) {
        expand_row(y + t * N + c0, xa + t * JR + block_slice[blk] * R, bs, R, N, column_blocks[blk + 1] - c0);
      }
    }
  });
}

void lora_sgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& groups, at::IntArrayRef output_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_sgmv: x [T, K] and y [T, N]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_sgmv: x, y, lora_a and lora_b must be contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_sgmv: x and y must have one dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat,
              "lora_sgmv: lora_a and lora_b must be float32");
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
  std::vector<int64_t> token_run;  // (run index << 32) | token offset within the run
  for (int64_t i = 0; i < groups.size(0); ++i) {
    const Run run{g[3 * i], g[3 * i + 1], g[3 * i + 2]};
    TORCH_CHECK(run.slot >= 0 && run.slot < S && run.start >= 0 && run.start <= run.end && run.end <= x.size(0),
                "lora_sgmv: group ", i, " (slot ", run.slot, ", tokens ", run.start, "..", run.end,
                ") is out of range");
    if (run.start == run.end) continue;
    for (int64_t t = 0; t < run.end - run.start; ++t) token_run.push_back((static_cast<int64_t>(runs.size()) << 32) | t);
    runs.push_back(run);
  }
  if (runs.empty()) return;

  std::vector<float> buffer(static_cast<size_t>(x.size(0) * JR));
  float* xa = buffer.data();
  const float* a = lora_a.data_ptr<float>();
  const float* b = lora_b.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat:
      shrink(xa, x.data_ptr<float>(), a, runs, token_run, K, JR);
      expand(y.data_ptr<float>(), xa, b, runs, column_blocks, block_slice, N, R, JR);
      break;
    case at::kBFloat16:
      shrink(xa, x.data_ptr<c10::BFloat16>(), a, runs, token_run, K, JR);
      expand(y.data_ptr<c10::BFloat16>(), xa, b, runs, column_blocks, block_slice, N, R, JR);
      break;
    case at::kHalf:
      shrink(xa, x.data_ptr<c10::Half>(), a, runs, token_run, K, JR);
      expand(y.data_ptr<c10::Half>(), xa, b, runs, column_blocks, block_slice, N, R, JR);
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
