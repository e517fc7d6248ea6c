// A mixture-of-experts layer's routed experts in one call: the gated MLP of every active
// expert over its tokens and the routing-weighted sum, from weights in linear_w16's blocks.
//
// Registered as torch.ops.pagedllm_cpu_<level>.pack_experts / fused_moe / fused_moe_w8 (see __init__.py):
//
//   pack_experts(weight [E, N, K] bfloat16 / float16 / float32 / int8)  ->  [E, ceil(N / 16), K, 16]
//     each expert's matrix in pack_w16's (int8: pack_w8's) layout (element (e, n, k) at
//     [e, n / 16, k, n % 16], the last block padded with zeros)
//   fused_moe(x [T, H] float32 / bfloat16 / float16, token_rows [P] int64, weights [P] float32,
//             counts (E ints), w13 packed [E, ceil(N13 / 16), H, 16], w2 packed
//             [E, ceil(H / 16), I, 16] (w13's dtype), activation, w13_bias [E, N13] or None,
//             w2_bias [E, H] or None)
//     ->  [T, H] in x's dtype: out[t] = sum over pairs p of token t of
//         weights[p] * (W2_e act(W13_e x[t] + b13_e) + b2_e), float32 throughout, one
//         rounding at the end
//   fused_moe_w8(x, token_rows, weights, counts, w13 [E, ceil(N13 / 16), H, 16] int8, w2
//                [E, ceil(H / 16), I, 16] int8, w13_scale [E, N13] float32, w2_scale [E, H]
//                float32, activation, w13_bias, w2_bias)
//     ->  the same for weight-only int8 experts, W13_e = w13_scale[e][:, None] * Q13_e (one
//         scale per output channel, as quantization/int8.py), W2_e likewise: the int8 weights
//         are widened to float32 in registers (exact) and each block's 16 sums multiplied by
//         their channels' scales once, before the bias; float32 activations throughout (no
//         int8 GEMM, no activation quantization), so only the float32 summation differs from
//         a matmul on the dequantized weights. Half the weight bytes of bfloat16 at batch 1.
//
// The pairs are ExpertGroups' (expert_groups.py): sorted by local expert, counts[e] of them
// for expert e, token_rows[p] the row of x of pair p. activation "silu": W13 is [gate | up]
// (N13 = 2 I) and act(h) = silu(gate) * up; "relu2_no_mul": W13 is up alone (N13 = I) and
// act(h) = relu(h)^2.
//
// One OpenMP parallel region per call, four phases separated by barriers:
//   1. the pairs' rows of x, widened to float32 [P, H];
//   2. h [P, N13] = x W13_e^T + b13: work items (active expert, block of 16 outputs), split in
//      contiguous runs of equal cost (a block's weight stream plus its rows), so each thread
//      streams a contiguous range of the stacked weights;
//   3. a [P, I] = act(h);
//   4. out [T, H]: each thread owns a contiguous range of output blocks and adds, expert by
//      expert in id order, weights[p] * (a W2_e^T + b2) for the expert's pairs into its
//      columns: no two threads write the same element, and every element is summed in the
//      same order whatever the number of threads.
// At batch 1 only the k active experts' weights are read, each byte once per call, both
// cores streaming at once. A block meets its rows kRows at a time (8 AVX-512, 4 AVX2; one or
// two rows alternate two accumulator sets), as linear_w16's few-row kernel, for any number of
// rows: a block (at most K x 32 bytes, 48 KB for K = 1536) stays in L2 while the rows go by.
// Portable builds: the same phases with scalar loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "simd.h"
#include "weight_blocks.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using pagedllm_blocks::kBlock;

constexpr int64_t kPrefetchAhead = 2048;  // elements ahead in a block's stream (4 KB of 16-bit)

template <typename T>
void pack_one(const T* w, int64_t n, int64_t k, T* out) {
  for (int64_t b = 0; b < (n + kBlock - 1) / kBlock; ++b) {
    T* ob = out + b * k * kBlock;
    for (int64_t j = 0; j < kBlock && b * kBlock + j < n; ++j) {
      const T* row = w + (b * kBlock + j) * k;
      for (int64_t i = 0; i < k; ++i) ob[i * kBlock + j] = row[i];
    }
  }
}

template <typename T>
void pack_all(const at::Tensor& w, at::Tensor& out) {
  const int64_t e = w.size(0), n = w.size(1), k = w.size(2), nb = (n + kBlock - 1) / kBlock;
  const T* src = w.const_data_ptr<T>();
  T* dst = out.mutable_data_ptr<T>();
  at::parallel_for(0, e, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack_one(src + i * n * k, n, k, dst + i * nb * k * kBlock);
  });
}

at::Tensor pack_experts(const at::Tensor& weight) {
  const auto wt = weight.scalar_type();
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 3 &&
                  (wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat || wt == at::kChar),
              "pack_experts: weight must be a bfloat16 / float16 / float32 / int8 CPU tensor [E, N, K]");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::zeros({w.size(0), (w.size(1) + kBlock - 1) / kBlock, w.size(2), kBlock}, w.options());
  switch (wt) {
    case at::kBFloat16: pack_all<c10::BFloat16>(w, out); break;
    case at::kHalf: pack_all<c10::Half>(w, out); break;
    case at::kChar: pack_all<int8_t>(w, out); break;
    default: pack_all<float>(w, out); break;
  }
  return out;
}

#ifdef PAGEDLLM_VEC
using pagedllm_simd::VecF;
using pagedllm_simd::kVecWidth;
constexpr int kLanes = kBlock / kVecWidth;  // vectors per input of a block: 1 (AVX-512) or 2 (AVX2)
constexpr int kRows = 8 / kLanes;           // rows of x per pass over a block (8 accumulators)

// R rows of x (float32, row stride ldx) times one block wb (K x 16) -> out[r][0..16). U
// accumulator sets take alternate inputs.
template <typename W, int R, int U>
PAGEDLLM_INLINE void block_rows(const float* x, int64_t ldx, const W* wb, int64_t k, float* out) {
  using namespace pagedllm_simd;
  VecF acc[U][R][kLanes];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) acc[u][r][l] = vset1(0.f);
  int64_t i = 0;
  for (; i + U <= k; i += U) {
    if (i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + i * kBlock + kPrefetchAhead), _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      VecF w[kLanes];
      for (int l = 0; l < kLanes; ++l) w[l] = vload(wb + (i + u) * kBlock + l * kVecWidth);
      for (int r = 0; r < R; ++r) {
        const VecF xv = vset1(x[r * ldx + i + u]);
        for (int l = 0; l < kLanes; ++l) acc[u][r][l] = vfmadd(xv, w[l], acc[u][r][l]);
      }
    }
  }
  for (; i < k; ++i) {  // U = 2 and K odd: the last input
    for (int l = 0; l < kLanes; ++l) {
      const VecF w = vload(wb + i * kBlock + l * kVecWidth);
      for (int r = 0; r < R; ++r) acc[0][r][l] = vfmadd(vset1(x[r * ldx + i]), w, acc[0][r][l]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < kLanes; ++l) {
      VecF sum = acc[0][r][l];
      for (int u = 1; u < U; ++u) sum = sum + acc[u][r][l];
      vstore(out + r * kBlock + l * kVecWidth, sum);
    }
}

// Rows [0, m) of x times block wb -> out [m, 16] (row stride 16), kRows rows at a time.
template <typename W>
void block_times_rows(const float* x, int64_t ldx, int64_t m, const W* wb, int64_t k, float* out) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) block_rows<W, kRows, 1>(x + r * ldx, ldx, wb, k, out + r * kBlock);
  const int64_t left = m - r;
  x += r * ldx;
  out += r * kBlock;
  if constexpr (kRows == 8) {
    if (left >= 4) {
      block_rows<W, 4, 1>(x, ldx, wb, k, out);
      x += 4 * ldx, out += 4 * kBlock;
    }
    switch (left % 4) {
      case 3: block_rows<W, 3, 1>(x, ldx, wb, k, out); break;
      case 2: block_rows<W, 2, 2>(x, ldx, wb, k, out); break;
      case 1: block_rows<W, 1, 2>(x, ldx, wb, k, out); break;
      default: break;
    }
  } else {
    switch (left) {
      case 3: block_rows<W, 3, 1>(x, ldx, wb, k, out); break;
      case 2: block_rows<W, 2, 2>(x, ldx, wb, k, out); break;
      case 1: block_rows<W, 1, 2>(x, ldx, wb, k, out); break;
      default: break;
    }
  }
}
#else
template <typename W>
void block_times_rows(const float* x, int64_t ldx, int64_t m, const W* wb, int64_t k, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    float acc[kBlock] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float xv = x[r * ldx + i];
      for (int64_t j = 0; j < kBlock; ++j) acc[j] += xv * static_cast<float>(wb[i * kBlock + j]);
    }
    for (int64_t j = 0; j < kBlock; ++j) out[r * kBlock + j] = acc[j];
  }
}
#endif

// [begin, end) of `n` equal items for thread `tid` of `nt`.
inline void even_split(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

// A block's sum v for output j, times the output's scale where the weights carry one.
inline float scaled(float v, const float* scale, int64_t j) { return scale ? v * scale[j] : v; }

// ceil(a / b) for b > 0 and any sign of a.
inline int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

struct Problem {
  int64_t t, h, inter, n13, nb13, nb2, pairs;
  bool gated;
  const int64_t* token_rows;
  const float* weights;
  const float* b13;  // [E, n13] or nullptr
  const float* b2;   // [E, h] or nullptr
  const float* s13;  // per-channel scales [E, n13] (int8 weights) or nullptr
  const float* s2;   // [E, h] or nullptr
  std::vector<int64_t> experts, starts, counts;  // active experts, their first pair and pair count
};

template <typename X, typename W>
void run(const Problem& p, const X* x, const W* w13, const W* w2, float* xs, float* hs, float* as, float* out) {
  const int64_t na = static_cast<int64_t>(p.experts.size());
  // Phase 2's cost of an item: a block's weight stream is worth ~4 rows of FMAs over it.
  std::vector<int64_t> cost_before(na + 1, 0);
  for (int64_t a = 0; a < na; ++a) cost_before[a + 1] = cost_before[a] + p.nb13 * (4 + p.counts[a]);
  const int64_t total_cost = cost_before[na];
#ifdef _OPENMP
#pragma omp parallel num_threads(at::get_num_threads())
#endif
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int tid = 0, nt = 1;
#endif
    alignas(64) float tile[8 * kBlock];
    int64_t begin, end;
    // 1. The pairs' rows, float32.
    even_split(p.pairs, tid, nt, begin, end);
    for (int64_t q = begin; q < end; ++q) {
      const X* src = x + p.token_rows[q] * p.h;
      float* dst = xs + q * p.h;
      for (int64_t i = 0; i < p.h; ++i) dst[i] = static_cast<float>(src[i]);
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    // 2. h = x W13^T + b13, items (active expert a, block b) split by cost.
    const int64_t lo = total_cost * tid / nt, hi = total_cost * (tid + 1) / nt;
    for (int64_t a = 0; a < na; ++a) {
      if (cost_before[a + 1] <= lo || cost_before[a] >= hi) continue;
      const int64_t e = p.experts[a], q0 = p.starts[a], m = p.counts[a], c = 4 + m;
      // Blocks b whose cost midpoint, cost_before[a] + (b + 1/2) c, falls in [lo, hi).
      const int64_t b_begin = std::clamp<int64_t>(ceil_div(2 * (lo - cost_before[a]) - c, 2 * c), 0, p.nb13);
      const int64_t b_end = std::clamp<int64_t>(ceil_div(2 * (hi - cost_before[a]) - c, 2 * c), 0, p.nb13);
      for (int64_t b = b_begin; b < b_end; ++b) {
        const W* wb = w13 + (e * p.nb13 + b) * p.h * kBlock;
        const int64_t n0 = b * kBlock, valid = std::min(kBlock, p.n13 - n0);
        const float* bias = p.b13 ? p.b13 + e * p.n13 + n0 : nullptr;
        const float* scale = p.s13 ? p.s13 + e * p.n13 + n0 : nullptr;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
          const int64_t rows = std::min<int64_t>(8, m - r0);
          block_times_rows(xs + (q0 + r0) * p.h, p.h, rows, wb, p.h, tile);
          for (int64_t r = 0; r < rows; ++r) {
            float* dst = hs + (q0 + r0 + r) * p.n13 + n0;
            for (int64_t j = 0; j < valid; ++j) dst[j] = scaled(tile[r * kBlock + j], scale, j) + (bias ? bias[j] : 0.f);
          }
        }
      }
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    // 3. a = act(h).
    even_split(p.pairs, tid, nt, begin, end);
    for (int64_t q = begin; q < end; ++q) {
      const float* hq = hs + q * p.n13;
      float* aq = as + q * p.inter;
      if (p.gated) {
        for (int64_t i = 0; i < p.inter; ++i) {
          const float g = hq[i];
          aq[i] = g / (1.f + std::exp(-g)) * hq[p.inter + i];
        }
      } else {
        for (int64_t i = 0; i < p.inter; ++i) {
          const float v = std::max(hq[i], 0.f);
          aq[i] = v * v;
        }
      }
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    // 4. out += weight * (a W2^T + b2), this thread's output blocks, expert by expert.
    even_split(p.nb2, tid, nt, begin, end);
    for (int64_t a = 0; a < na; ++a) {
      const int64_t e = p.experts[a], q0 = p.starts[a], m = p.counts[a];
      for (int64_t b = begin; b < end; ++b) {
        const W* wb = w2 + (e * p.nb2 + b) * p.inter * kBlock;
        const int64_t n0 = b * kBlock, valid = std::min(kBlock, p.h - n0);
        const float* bias = p.b2 ? p.b2 + e * p.h + n0 : nullptr;
        const float* scale = p.s2 ? p.s2 + e * p.h + n0 : nullptr;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
          const int64_t rows = std::min<int64_t>(8, m - r0);
          block_times_rows(as + (q0 + r0) * p.inter, p.inter, rows, wb, p.inter, tile);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t q = q0 + r0 + r;
            const float wq = p.weights[q];
            float* dst = out + p.token_rows[q] * p.h + n0;
            for (int64_t j = 0; j < valid; ++j) dst[j] += wq * (scaled(tile[r * kBlock + j], scale, j) + (bias ? bias[j] : 0.f));
          }
        }
      }
    }
  }
}

at::Tensor checked_bias(const std::optional<at::Tensor>& bias, int64_t e, int64_t n, const char* name) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 2 && bias->size(0) == e && bias->size(1) == n,
              "fused_moe: ", name, " must be a CPU tensor [", e, ", ", n, "]");
  return bias->to(at::kFloat).contiguous();
}

// The checked scales of int8 experts: [E, n] float32, or an undefined tensor for 16/32-bit ones.
at::Tensor checked_scale(const std::optional<at::Tensor>& scale, int64_t e, int64_t n, const char* name) {
  if (!scale.has_value()) return at::Tensor();
  TORCH_CHECK(scale->defined() && scale->device().is_cpu() && scale->dim() == 2 && scale->size(0) == e &&
                  scale->size(1) == n && scale->scalar_type() == at::kFloat,
              "fused_moe_w8: ", name, " must be a float32 CPU tensor [", e, ", ", n, "]");
  return scale->contiguous();
}

// fused_moe and fused_moe_w8: w13_scale / w2_scale given (both) for int8 weights, else none.
at::Tensor fused_moe_any(const char* op, const at::Tensor& x, const at::Tensor& token_rows, const at::Tensor& weights,
                         at::IntArrayRef counts, const at::Tensor& w13, const at::Tensor& w2,
                         const std::optional<at::Tensor>& w13_scale, const std::optional<at::Tensor>& w2_scale,
                         const std::string& activation, const std::optional<at::Tensor>& w13_bias,
                         const std::optional<at::Tensor>& w2_bias) {
  const auto xt = x.scalar_type(), wt = w13.scalar_type();
  const bool int8 = w13_scale.has_value();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf),
              op, ": x must be a float32 / bfloat16 / float16 CPU tensor [T, H]");
  TORCH_CHECK(activation == "silu" || activation == "relu2_no_mul", op, ": activation must be \"silu\" or "
              "\"relu2_no_mul\", got \"", activation, "\"");
  const int64_t t = x.size(0), h = x.size(1), e = static_cast<int64_t>(counts.size());
  const bool dtype_ok = int8 ? wt == at::kChar : (wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat);
  TORCH_CHECK(w13.device().is_cpu() && w2.device().is_cpu() && w13.dim() == 4 && w2.dim() == 4 &&
                  w13.size(3) == kBlock && w2.size(3) == kBlock && w13.is_contiguous() && w2.is_contiguous() &&
                  dtype_ok && w2.scalar_type() == wt,
              op, ": w13 and w2 must be contiguous CPU tensors of one dtype (",
              int8 ? "int8" : "bfloat16 / float16 / float32", ") packed by pack_experts ([E, N / 16, K, 16])");
  TORCH_CHECK(w13.size(0) == e && w2.size(0) == e, op, ": ", e, " counts for ", w13.size(0), " experts in w13 and ",
              w2.size(0), " in w2");
  const int64_t inter = w2.size(2), nb2 = w2.size(1), nb13 = w13.size(1);
  const bool gated = activation == "silu";
  const int64_t n13 = gated ? 2 * inter : inter;
  TORCH_CHECK(w13.size(2) == h && nb13 == (n13 + kBlock - 1) / kBlock && nb2 == (h + kBlock - 1) / kBlock,
              op, ": w13 [E, ", nb13, ", ", w13.size(2), ", 16] and w2 [E, ", nb2, ", ", inter,
              ", 16] do not fit x's hidden size ", h, " under activation \"", activation, "\" (W13 [", n13, ", ", h,
              "], W2 [", h, ", ", inter, "] per expert)");
  const at::Tensor s13 = checked_scale(w13_scale, e, n13, "w13_scale"), s2 = checked_scale(w2_scale, e, h, "w2_scale");
  int64_t pairs = 0;
  Problem p;
  for (int64_t i = 0; i < e; ++i) {
    TORCH_CHECK(counts[i] >= 0, op, ": counts must not be negative");
    if (counts[i]) {
      p.experts.push_back(i);
      p.starts.push_back(pairs);
      p.counts.push_back(counts[i]);
    }
    pairs += counts[i];
  }
  TORCH_CHECK(token_rows.device().is_cpu() && token_rows.dim() == 1 && token_rows.size(0) == pairs &&
                  token_rows.scalar_type() == at::kLong,
              op, ": token_rows must be an int64 CPU tensor of the counts' sum (", pairs, ")");
  TORCH_CHECK(weights.device().is_cpu() && weights.dim() == 1 && weights.size(0) == pairs &&
                  weights.scalar_type() == at::kFloat,
              op, ": weights must be a float32 CPU tensor of the counts' sum (", pairs, ")");
  const at::Tensor rows = token_rows.contiguous(), wts = weights.contiguous(), xc = x.contiguous();
  if (pairs) {
    TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < t,
                op, ": token_rows must index x's ", t, " rows");
  }
  const at::Tensor b13 = checked_bias(w13_bias, e, n13, "w13_bias"), b2 = checked_bias(w2_bias, e, h, "w2_bias");
  at::Tensor out = at::zeros({t, h}, x.options().dtype(at::kFloat));
  if (pairs == 0) return xt == at::kFloat ? out : out.to(xt);
  p.t = t, p.h = h, p.inter = inter, p.n13 = n13, p.nb13 = nb13, p.nb2 = nb2, p.pairs = pairs, p.gated = gated;
  p.token_rows = rows.const_data_ptr<int64_t>();
  p.weights = wts.const_data_ptr<float>();
  p.b13 = b13.defined() ? b13.const_data_ptr<float>() : nullptr;
  p.b2 = b2.defined() ? b2.const_data_ptr<float>() : nullptr;
  p.s13 = s13.defined() ? s13.const_data_ptr<float>() : nullptr;
  p.s2 = s2.defined() ? s2.const_data_ptr<float>() : nullptr;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor xs = at::empty({pairs, h}, f32), hs = at::empty({pairs, n13}, f32), as = at::empty({pairs, inter}, f32);
  float *xsp = xs.mutable_data_ptr<float>(), *hsp = hs.mutable_data_ptr<float>(), *asp = as.mutable_data_ptr<float>();
  float* op_out = out.mutable_data_ptr<float>();
  const auto with_weights = [&](const auto* xp) {
    const auto go = [&](const auto* w13p, const auto* w2p) { run(p, xp, w13p, w2p, xsp, hsp, asp, op_out); };
    switch (wt) {
      case at::kBFloat16: go(w13.const_data_ptr<c10::BFloat16>(), w2.const_data_ptr<c10::BFloat16>()); break;
      case at::kHalf: go(w13.const_data_ptr<c10::Half>(), w2.const_data_ptr<c10::Half>()); break;
      case at::kChar: go(w13.const_data_ptr<int8_t>(), w2.const_data_ptr<int8_t>()); break;
      default: go(w13.const_data_ptr<float>(), w2.const_data_ptr<float>()); break;
    }
  };
  switch (xt) {
    case at::kFloat: with_weights(xc.const_data_ptr<float>()); break;
    case at::kBFloat16: with_weights(xc.const_data_ptr<c10::BFloat16>()); break;
    default: with_weights(xc.const_data_ptr<c10::Half>()); break;
  }
  return xt == at::kFloat ? out : out.to(xt);
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& token_rows, const at::Tensor& weights,
                     at::IntArrayRef counts, const at::Tensor& w13, const at::Tensor& w2, const std::string& activation,
                     const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  return fused_moe_any("fused_moe", x, token_rows, weights, counts, w13, w2, std::nullopt, std::nullopt, activation,
                       w13_bias, w2_bias);
}

at::Tensor fused_moe_w8(const at::Tensor& x, const at::Tensor& token_rows, const at::Tensor& weights,
                        at::IntArrayRef counts, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& w13_scale,
                        const at::Tensor& w2_scale, const std::string& activation,
                        const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  return fused_moe_any("fused_moe_w8", x, token_rows, weights, counts, w13, w2, w13_scale, w2_scale, activation,
                       w13_bias, w2_bias);
}

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("pack_experts(Tensor weight) -> Tensor");
  m.def("fused_moe(Tensor x, Tensor token_rows, Tensor weights, int[] counts, Tensor w13, Tensor w2, str activation, "
        "Tensor? w13_bias, Tensor? w2_bias) -> Tensor");
  m.def("fused_moe_w8(Tensor x, Tensor token_rows, Tensor weights, int[] counts, Tensor w13, Tensor w2, "
        "Tensor w13_scale, Tensor w2_scale, str activation, Tensor? w13_bias, Tensor? w2_bias) -> Tensor");
}

PAGEDLLM_IMPL(CompositeExplicitAutograd, m) {
  m.impl("pack_experts", &pack_experts);
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_w8", &fused_moe_w8);
}
