// Paged decode attention for CPU: one query token per request, K/V read from the paged cache.
//
// Registered as the operator torch.ops.pagedllm_cpu_<level>.paged_decode_attention (see __init__.py,
// which builds this file with torch.utils.cpp_extension.load on first use).
//
//   out         [B, Hq, D]                          written in place, dtype of query
//   query       [B, Hq, D]
//   key_cache   [num_blocks, block_size, Hkv, D]    (kv_cache[0]; any strides, D contiguous)
//   value_cache [num_blocks, block_size, Hkv, D]    (kv_cache[1])
//   block_table [B, max_blocks] int64
//   seq_lens    [B] int64, context length including the new token; cache positions
//               >= seq_len are never read.
//   k_scale, v_scale  FP8 caches: K = k_scale * stored key, V = v_scale * stored value (1 otherwise).
//
// The caches have the query's dtype, or float8 (e4m3fn or e5m2: --kv-cache-dtype fp8), widened
// exactly as they are loaded, 16 or 32 at a time, by moving bits (no per-element multiply);
// k_scale is folded into the scaled query and v_scale into the softmax's 1 / sum, so scaling
// costs nothing per element.
//
// Work: one (request, kv head) pair at a time; the G = Hq / Hkv query heads of that kv head
// are computed together, so each K and V row is loaded once (G > 8 is split into sub-groups
// of at most 8). Consecutive query tokens over one context (a prompt chunk's tokens, or a
// speculative verifying step's 1 + k: equal block tables over the blocks each reads, lengths
// growing by one) are computed together too on the vector paths, up to 8 / G tokens, as
// G x tokens "heads" sharing each K and V row load; token j of such a run has its own length
// (its scores past it get weight 0; the later tokens' rows it skips are in the cache). Two passes in float32: the scores q.k of the whole context into a
// per-thread buffer, softmax, then the weighted sum of V. The rows of a request are visited
// 16 tokens at a time (a "tile", whatever the block size), through a cursor that walks the
// block table and software-prefetches the rows of the blocks 32 tokens ahead into L2: blocks
// lie anywhere in the cache, so the hardware prefetchers cannot run ahead (without this, 3x
// slower). Items are handed out to the threads of ATen's pool from an atomic counter, so
// uneven lengths balance; with enough requests an item is a whole request (its kv heads one
// after the other on one core). paged_decode_attention_per_token forms no runs: each token's
// output then comes from the same operations whatever tokens share the call (--batch-invariant).
//
// Vector path (AVX-512F, when the compiler targets it; head_dim % 16 == 0, head_dim <= 256):
//   scores: the tile's 16 K rows are transposed in registers so that one vector holds one
//     element of 16 tokens; q . k is then a broadcast multiply-add per element, with no
//     horizontal sums. For bfloat16 with AVX512-BF16 (head_dim % 32 == 0), pairs of elements
//     go through vdpbf16ps (bf16 products are exact in float32).
//   values: float32 multiply-add of each V row by its weight; for bfloat16 with AVX512-BF16,
//     the weights are rounded to bfloat16 and two tokens' rows are interleaved for
//     vdpbf16ps (accumulation stays float32; this is what bf16 attention kernels do).
//   FP8 caches with bfloat16 queries and AVX512-BF16: rows are widened to bfloat16 in registers,
//     32 elements at a time, as they are loaded into the same vdpbf16ps steps (the keys, with
//     head_dim % 64 == 0, transposed as bytes before widening: qk_tile_fp8; load32_bf16:
//     shifts and an add rebias the exponent; zero and subnormals come from a 32-entry vpermw
//     table); otherwise FP8 rows are widened to float32 (load16: e4m3 through float16, as its
//     value x 2^-8, the 2^8 folded into the scales).
// AVX2 path (AVX2 builds; head_dim % 8 == 0, head_dim <= 256; simd.h's 8-lane vectors):
//   scores: one key row at a time, widened once and multiplied into G accumulators, each
//     summed across lanes; softmax with Cephes' exp; values as the float32 AVX-512 path.
// Portable path (any other shape, or portable builds): plain loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_AVX512 1
#endif

namespace {

constexpr int kTile = 16;           // tokens per tile
constexpr int kMaxGroup = 8;        // query heads per kv head in one vector-path sweep
constexpr int64_t kMaxVecDim = 256; // largest head_dim of the vector path
constexpr int64_t kPrefetchTokens = 32;

struct Params {
  int64_t batch, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks, num_blocks;
  int64_t q_sb, q_sh, o_sb, o_sh;
  int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh;
  int64_t bt_s0, bt_s1, sl_s0;
  float scale;
  float k_scale, v_scale;  // FP8 cache: stored K = key / k_scale, V = value / v_scale (1 otherwise)
};

// T: query and output; C: the cache (T, or float8 e4m3 / e5m2).
template <typename T, typename C>
struct Ptrs {
  const T* q;
  T* o;
  const C* k;
  const C* v;
  const int64_t* block_table;
  const int64_t* seq_lens;
};

// Per-thread scratch (64-byte aligned parts): scores [group][cap] float (cap >= every seq_len
// rounded up to the tile, a multiple of 32), weights16 [group][cap] 16-bit, acc
// [group * head_dim] float, q [group * head_dim] float, row [head_dim] float, inv_sum [group].
struct Scratch {
  float* scores;
  int64_t cap;
  uint16_t* weights16;
  float* acc;
  float* q;
  float* row;
  float* inv_sum;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline int64_t block_id(const Params& p, const int64_t* block_table, int64_t b, int64_t i) {
  const int64_t blk = block_table[b * p.bt_s0 + i * p.bt_s1];
  TORCH_CHECK(blk >= 0 && blk < p.num_blocks, "paged_decode_attention: block id ", blk, " out of range [0, ",
              p.num_blocks, ") for request ", b);
  return blk;
}

// Prefetch into L2 (prefetcht0, into L1, measured slower: too many misses in flight for L1).
// GCC's dead-code elimination deletes loops whose only effect is __builtin_prefetch, so on x86
// the instruction is emitted with asm volatile.
inline void prefetch_l2(const void* ptr) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(ptr)));
#elif defined(__GNUC__)
  __builtin_prefetch(ptr, 0, 2);
#else
  (void)ptr;
#endif
}

// The rows of one kv head of one request, in token order: walks the block table (checking
// each block id) and prefetches the rows of the block kPrefetchTokens ahead. Constructing it
// prefetches the first blocks.
template <typename T>
class RowCursor {
 public:
  RowCursor(const Params& p, const int64_t* block_table, int64_t b, const T* head, int64_t stride_block,
            int64_t stride_token, int64_t n)
      : p_(p), block_table_(block_table), b_(b), head_(head), stride_block_(stride_block),
        stride_token_(stride_token), num_seq_blocks_((n + p.block_size - 1) / p.block_size),
        ahead_(std::max<int64_t>(1, (kPrefetchTokens + p.block_size - 1) / p.block_size)),
        row_bytes_(p.head_dim * static_cast<int64_t>(sizeof(T))), off_(p.block_size) {
    for (int64_t i = 0; i < ahead_; ++i) prefetch_block(i);
  }

  PAGEDLLM_INLINE const T* next() {
    if (off_ == p_.block_size) next_block();
    return base_ + (off_++) * stride_token_;
  }

 private:
  PAGEDLLM_NOINLINE void next_block() {
    ++index_;
    base_ = head_ + block_id(p_, block_table_, b_, index_) * stride_block_;
    off_ = 0;
    prefetch_block(index_ + ahead_);
  }

  void prefetch_block(int64_t i) const {
    if (i >= num_seq_blocks_) return;
    const int64_t blk = block_table_[b_ * p_.bt_s0 + i * p_.bt_s1];
    if (blk < 0 || blk >= p_.num_blocks) return;  // reported when the block is read
    const char* base = reinterpret_cast<const char*>(head_ + blk * stride_block_);
    for (int64_t off = 0; off < p_.block_size; ++off) {
      const char* row = base + off * stride_token_ * static_cast<int64_t>(sizeof(T));
      for (int64_t l = 0; l < row_bytes_; l += 64) prefetch_l2(row + l);
    }
  }

  const Params& p_;
  const int64_t* block_table_;
  int64_t b_;
  const T* head_;
  int64_t stride_block_, stride_token_, num_seq_blocks_, ahead_, row_bytes_;
  int64_t index_ = -1;
  int64_t off_;
  const T* base_ = nullptr;
};

// A cache value is kRowLoadFactor times what the float32 vector paths' row loads return
// (load16, load8): they read e4m3 through float16 as its value x 2^-8, and the factor is
// folded into the scaled query and the softmax's 1 / sum.
template <typename C>
constexpr float kRowLoadFactor = 1.f;
template <>
constexpr float kRowLoadFactor<c10::Float8_e4m3fn> = 256.f;

// Query heads [h * group + g0, h * group + g0 + count) of query tokens b .. b + tokens - 1
// (one context: a run, see the header) against kv head h; n is the last token's length
// (token j's is n - (tokens - 1 - j)), and the last token's block table row is read.
// Member i of the G = count x tokens computed together is head g0 + i % count of token
// b + i / count.
struct Work {
  int64_t b, h, g0, count, n, tokens;

  int64_t token(int64_t i) const { return b + i / count; }
  int64_t head(const Params& p, int64_t i) const { return h * p.group + g0 + i % count; }
  int64_t len(int64_t i) const { return n - (tokens - 1 - i / count); }
  int64_t table_row() const { return b + tokens - 1; }
};

// ---------------------------------------------------------------------------------------------
// Portable path (single query tokens: runs are formed on the vector paths only).

template <typename T, typename C>
void attend_portable(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) {
  const int64_t G = wk.count, D = p.head_dim, cap = w.cap, n = wk.n, b = wk.b, h = wk.h;
  float *scores = w.scores, *acc = w.acc, *qf = w.q, *row = w.row, *inv_sum = w.inv_sum;
  for (int64_t g = 0; g < G; ++g) {
    const T* q = x.q + b * p.q_sb + (h * p.group + wk.g0 + g) * p.q_sh;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[d]) * (p.scale * p.k_scale);
  }
  RowCursor<C> keys(p, x.block_table, b, x.k + h * p.k_sh, p.k_sb, p.k_st, n);
  for (int64_t t = 0; t < n; ++t) {
    const C* k = keys.next();
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
      scores[g * cap + t] = s;
    }
  }
  RowCursor<C> values(p, x.block_table, b, x.v + h * p.v_sh, p.v_sb, p.v_st, n);
  for (int64_t g = 0; g < G; ++g) {  // softmax, unnormalised; divided by the sum at the end
    float* s = scores + g * cap;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[g] = p.v_scale / sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const C* v = values.next();
    for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float wt = scores[g * cap + t];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += wt * row[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    T* o = x.o + b * p.o_sb + (h * p.group + wk.g0 + g) * p.o_sh;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path.

#ifdef PAGEDLLM_AVX512

alignas(64) const float kZeroRow[kMaxVecDim] = {};  // stands in for the rows past seq_len

// 16 elements of T widened to float32 (simd.h's AVX-512 VecF).
template <typename T>
PAGEDLLM_INLINE __m512 load16(const T* p) { return pagedllm_simd::vload(p).v; }
// 16 e4m3 values times 2^-8 (kRowLoadFactor): the sign-extended byte shifted left by 7, with
// bit 14 (a sign copy) cleared, is the float16 of that product, exactly (subnormals too).
PAGEDLLM_INLINE __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16(float) (values here are finite).
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x <= 0 (arguments are score - max): Cody-Waite reduction, degree-7 Taylor
// polynomial on |r| <= ln2/2 (relative error ~1e-7), scaled by 2^n with scalef.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp(-104) underflows to 0 via scalef
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.f / 5040.f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 720.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// In-place transpose of a 16 x 16 matrix of 32-bit elements: r[i] lane j -> r[j] lane i.
PAGEDLLM_INLINE void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 32-bit interleave of row pairs
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4R + p], 128-bit lane l = rows 4R..4R+3, element 4l + p
  __m512i u[16];
  for (int R = 0; R < 4; ++R) {
    const __m512i* tt = t + 4 * R;
    u[4 * R + 0] = _mm512_unpacklo_epi64(tt[0], tt[2]);
    u[4 * R + 1] = _mm512_unpackhi_epi64(tt[0], tt[2]);
    u[4 * R + 2] = _mm512_unpacklo_epi64(tt[1], tt[3]);
    u[4 * R + 3] = _mm512_unpackhi_epi64(tt[1], tt[3]);
  }
  for (int q = 0; q < 4; ++q) {
    // v0 = lanes [R0.l0, R0.l1, R1.l0, R1.l1], v1 = [R0.l2, R0.l3, R1.l2, R1.l3]; w0/w1 for R2, R3
    const __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(3, 2, 3, 2));
    r[0 + q] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + q] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + q] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + q] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Softmax numerators of s[0, n) in place; s[n, round_up(n, 16)) set to 0. Returns 1 / sum.
inline float softmax_inplace(float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail_mask(n - i), s + i));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sv = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx)));
    _mm512_storeu_ps(s + i, e);
    sv = _mm512_add_ps(sv, e);
  }
  return 1.f / _mm512_reduce_add_ps(sv);
}

// Scores of one tile for G query heads, float32 products: qf [G][D] scaled queries.
template <typename T, int G>
PAGEDLLM_INLINE void qk_tile_f32(const float* qf, int64_t D, const T* const* rows, float* scores, int64_t cap) {
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(load16(rows[j] + c));
    transpose16x16(r);  // r[e] = element c + e of the 16 tokens
    for (int e = 0; e < 16; ++e) {
      const __m512 kv = _mm512_castsi512_ps(r[e]);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * D + c + e]), kv, acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * cap, acc[g]);
}

// Values of one tile, float32: acc [G][D] += w[g][t] * v[t] for the first cnt rows.
template <typename T, int G>
PAGEDLLM_INLINE void pv_tile_f32(const T* const* rows, int cnt, const float* w, int64_t cap, float* acc, int64_t D) {
  for (int64_t c = 0; c < D; c += 16) {
    __m512 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm512_load_ps(acc + g * D + c);
    for (int j = 0; j < cnt; ++j) {
      const __m512 vv = load16(rows[j] + c);
      for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * cap + j]), vv, a[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_store_ps(acc + g * D + c, a[g]);
  }
}

#if defined(__AVX512BF16__)
template <typename C>
constexpr bool kIsFp8 = std::is_same<C, c10::Float8_e4m3fn>::value || std::is_same<C, c10::Float8_e5m2>::value;

// 32 elements as bfloat16 bits: bfloat16 rows as they are; FP8 rows widened exactly. A byte
// s|e|m (E exponent bits, bias B, M = 7 - E mantissa bits) is sign-extended to 16 bits;
// shifting it left by 7 - M puts the sign at bit 15 and e|m at bfloat16's exponent and
// mantissa positions, the mask drops the sign copies between, and adding (127 - B) << 7
// rebiases the exponent: exact for every e >= 1. The e = 0 bytes (zero and subnormals) take
// their magnitude from a 32-entry table indexed by the byte's low 5 bits (vpermw), then the
// sign. NaN and e5m2's infinities read as large finite values, as in simd.h (the cache writer
// saturates, so only NaN keys or values could make them).
PAGEDLLM_INLINE __m512i load32_bf16(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }

// bfloat16 bits of the e = 0 magnitudes: e4m3 m x 2^-9 (m = 0..7), e5m2 m x 2^-16 (m = 0..3).
alignas(64) constexpr uint16_t kE4m3Subnormals[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
alignas(64) constexpr uint16_t kE5m2Subnormals[32] = {0, 0x3780, 0x3800, 0x3840};

template <int kExpBits, int kBias>
PAGEDLLM_INLINE __m512i fp8_to_bf16(__m256i bytes, const uint16_t* subnormals) {
  constexpr int kMantBits = 7 - kExpBits, kShift = 7 - kMantBits;
  const __m512i table = _mm512_load_si512(subnormals);
  const __m512i x = _mm512_cvtepi8_epi16(bytes);
  const __m512i normal =
      _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, kShift), _mm512_set1_epi16(static_cast<int16_t>(0x8000 | (0x7f << kShift)))),
                       _mm512_set1_epi16((127 - kBias) << 7));
  const __mmask32 zero_exp = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x7f & ~((1 << kMantBits) - 1)));
  const __m512i magnitude = _mm512_mask_permutexvar_epi16(normal, zero_exp, x, table);
  return _mm512_ternarylogic_epi32(magnitude, x, _mm512_set1_epi16(-0x8000), 0xF8);  // magnitude | (x & bit 15)
}
PAGEDLLM_INLINE __m512i widen32_bf16(__m256i bytes, c10::Float8_e4m3fn) { return fp8_to_bf16<4, 7>(bytes, kE4m3Subnormals); }
PAGEDLLM_INLINE __m512i widen32_bf16(__m256i bytes, c10::Float8_e5m2) { return fp8_to_bf16<5, 15>(bytes, kE5m2Subnormals); }
template <typename C, typename = std::enable_if_t<kIsFp8<C>>>
PAGEDLLM_INLINE __m512i load32_bf16(const C* p) {
  return widen32_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), C());
}

// Scores of one tile, bfloat16 pairs through vdpbf16ps: qp [G][D] bf16 queries (unscaled);
// rows bfloat16 or FP8 (R).
template <typename R, int G>
PAGEDLLM_INLINE void qk_tile_bf16(const uint16_t* qp, int64_t D, const R* const* rows, float scale, float* scores,
                         int64_t cap) {
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = load32_bf16(rows[j] + c);
    transpose16x16(r);  // r[e] = elements c + 2e, c + 2e + 1 of the 16 tokens
    for (int e = 0; e < 16; ++e) {
      for (int g = 0; g < G; ++g) {
        int32_t pair;
        std::memcpy(&pair, qp + g * D + c + 2 * e, sizeof(pair));
        acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)r[e], (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * cap, _mm512_mul_ps(acc[g], sc));
}

// Scores of one tile from FP8 keys, head_dim % 64 == 0: the rows' bytes are transposed first
// (one 16 x 16 transpose of 4-byte groups per 64 elements, half the shuffles of the bfloat16
// rows' transposes), so r[e] holds elements c + 4e .. c + 4e + 3 of the 16 tokens; its low and
// high halves (tokens 0-7, 8-15) widen to pairs (4e, 4e + 1), (4e + 2, 4e + 3) in adjacent
// 32-bit lanes, and vdpbf16ps against the query's 4 elements repeated leaves token t's sum
// split over lanes 2t and 2t + 1, added at the end. qp [G][D] bf16 queries (unscaled).
template <typename C, int G>
PAGEDLLM_INLINE void qk_tile_fp8(const uint16_t* qp, int64_t D, const C* const* rows, float scale, float* scores,
                                 int64_t cap) {
  __m512 lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 64) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j] + c);
    transpose16x16(r);
    for (int e = 0; e < 16; ++e) {
      const __m512bh a = (__m512bh)widen32_bf16(_mm512_castsi512_si256(r[e]), C());
      const __m512bh b = (__m512bh)widen32_bf16(_mm512_extracti64x4_epi64(r[e], 1), C());
      for (int g = 0; g < G; ++g) {
        int64_t quad;
        std::memcpy(&quad, qp + g * D + c + 4 * e, sizeof(quad));
        const __m512bh qv = (__m512bh)_mm512_set1_epi64(quad);
        lo[g] = _mm512_dpbf16_ps(lo[g], a, qv);
        hi[g] = _mm512_dpbf16_ps(hi[g], b, qv);
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(lo[g], even, hi[g]), _mm512_permutex2var_ps(lo[g], odd, hi[g]));
    _mm512_storeu_ps(scores + g * cap, _mm512_mul_ps(sum, sc));
  }
}

// Values of one tile, bfloat16 through vdpbf16ps: token pairs (2j, 2j+1) are interleaved
// element-wise; wp [G][cap] bf16 weights (pairs read as 32 bits). acc holds, per 32 elements
// c..c+31, two vectors "lo" and "hi" in the order of unpacklo/hi_epi16 (undone at the end).
// Rows bfloat16 or FP8 (R).
template <typename R, int G>
PAGEDLLM_INLINE void pv_tile_bf16(const R* const* rows, int cnt, const uint16_t* wp, int64_t cap, float* acc,
                         int64_t D) {
  const int pairs = (cnt + 1) / 2;
  for (int64_t c = 0; c < D; c += 32) {
    __m512 lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      lo[g] = _mm512_load_ps(acc + g * D + c);
      hi[g] = _mm512_load_ps(acc + g * D + c + 16);
    }
    for (int j = 0; j < pairs; ++j) {
      const __m512i a = load32_bf16(rows[2 * j] + c);
      const __m512i b = load32_bf16(rows[2 * j + 1] + c);
      const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh u = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < G; ++g) {
        int32_t pair;
        std::memcpy(&pair, wp + g * cap + 2 * j, sizeof(pair));
        const __m512bh wv = (__m512bh)_mm512_set1_epi32(pair);
        lo[g] = _mm512_dpbf16_ps(lo[g], l, wv);
        hi[g] = _mm512_dpbf16_ps(hi[g], u, wv);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm512_store_ps(acc + g * D + c, lo[g]);
      _mm512_store_ps(acc + g * D + c + 16, hi[g]);
    }
  }
}
#endif


template <typename T, typename C, int G>
void attend_avx512(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) {
  const int64_t D = p.head_dim, cap = w.cap, n = wk.n, h = wk.h;
  float *scores = w.scores, *acc = w.acc;
#if defined(__AVX512BF16__)
  // bfloat16 queries over a bfloat16 or FP8 cache: vdpbf16ps (FP8 rows widened to bfloat16).
  constexpr bool kBf16 = std::is_same<T, c10::BFloat16>::value && (std::is_same<C, T>::value || kIsFp8<C>);
#else
  constexpr bool kBf16 = false;
#endif
  const bool bf16_dot = kBf16 && D % 32 == 0;
  // The float32 path reads e4m3 as its value x 2^-8 (load16); the scales restore it.
  const float widen = bf16_dot ? 1.f : kRowLoadFactor<C>;
  const C* zero_row = reinterpret_cast<const C*>(kZeroRow);
  const C* rows[kTile];

  // Pass 1: scores.
  RowCursor<C> keys(p, x.block_table, wk.table_row(), x.k + h * p.k_sh, p.k_sb, p.k_st, n);
  if (bf16_dot) {
    uint16_t* qp = reinterpret_cast<uint16_t*>(w.q);
    for (int g = 0; g < G; ++g) std::memcpy(qp + g * D, x.q + wk.token(g) * p.q_sb + wk.head(p, g) * p.q_sh, D * sizeof(T));
  } else {
    const __m512 sc = _mm512_set1_ps(p.scale * p.k_scale * widen);
    for (int g = 0; g < G; ++g) {
      const T* q = x.q + wk.token(g) * p.q_sb + wk.head(p, g) * p.q_sh;
      for (int64_t c = 0; c < D; c += 16) _mm512_store_ps(w.q + g * D + c, _mm512_mul_ps(load16(q + c), sc));
    }
  }
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    for (int j = 0; j < kTile; ++j) rows[j] = j < cnt ? keys.next() : zero_row;
#if defined(__AVX512BF16__)
    if constexpr (kBf16 && kIsFp8<C>) {
      if (bf16_dot && D % 64 == 0) {
        qk_tile_fp8<C, G>(reinterpret_cast<const uint16_t*>(w.q), D, rows, p.scale * p.k_scale, scores + t0, cap);
        continue;
      }
    }
    if constexpr (kBf16) {
      if (bf16_dot) {
        qk_tile_bf16<C, G>(reinterpret_cast<const uint16_t*>(w.q), D, rows, p.scale * p.k_scale, scores + t0, cap);
        continue;
      }
    }
#endif
    qk_tile_f32<C, G>(w.q, D, rows, scores + t0, cap);
  }

  // Softmax (V rows start arriving meanwhile), each member over its own length; its weights
  // past it are 0 up to the last tile.
  RowCursor<C> values(p, x.block_table, wk.table_row(), x.v + h * p.v_sh, p.v_sb, p.v_st, n);
  float inv_sum[G];
  const int64_t n_tiles = round_up(n, kTile);
  for (int g = 0; g < G; ++g) {
    const int64_t len = wk.len(g);
    inv_sum[g] = softmax_inplace(scores + g * cap, len) * p.v_scale * widen;
    for (int64_t i = round_up(len, 16); i < n_tiles; i += 16) _mm512_storeu_ps(scores + g * cap + i, _mm512_setzero_ps());
  }
  if (bf16_dot) {  // weights to bfloat16 (round to nearest even)
    for (int g = 0; g < G; ++g) {
      for (int64_t i = 0; i < n_tiles; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(scores + g * cap + i));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.weights16 + g * cap + i), _mm512_cvtepi32_epi16(r));
      }
    }
  }

  // Pass 2: weighted sum of the values.
  for (int64_t i = 0; i < G * D; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    for (int j = 0; j < kTile; ++j) rows[j] = j < cnt ? values.next() : zero_row;
#if defined(__AVX512BF16__)
    if constexpr (kBf16) {
      if (bf16_dot) {
        pv_tile_bf16<C, G>(rows, cnt, w.weights16 + t0, cap, acc, D);
        continue;
      }
    }
#endif
    pv_tile_f32<C, G>(rows, cnt, scores + t0, cap, acc, D);
  }

  for (int g = 0; g < G; ++g) {
    T* o = x.o + wk.token(g) * p.o_sb + wk.head(p, g) * p.o_sh;
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    const float* a = acc + g * D;
    if (bf16_dot) {  // undo the unpacklo/hi_epi16 order
      const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      for (int64_t c = 0; c < D; c += 32) {
        const __m512 lo = _mm512_load_ps(a + c), hi = _mm512_load_ps(a + c + 16);
        store16(o + c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx0, hi), inv));
        store16(o + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, idx1, hi), inv));
      }
    } else {
      for (int64_t c = 0; c < D; c += 16) store16(o + c, _mm512_mul_ps(_mm512_load_ps(a + c), inv));
    }
  }
}

#endif  // PAGEDLLM_AVX512

#if defined(PAGEDLLM_VEC) && !defined(PAGEDLLM_AVX512)
// ---------------------------------------------------------------------------------------------
// AVX2 path (simd.h's 8-lane VecF; head_dim % 8 == 0).

// 8 cache elements as float32 (e4m3: times 2^-8, as load16 on AVX-512).
template <typename C>
PAGEDLLM_INLINE pagedllm_simd::VecF load8(const C* p) { return pagedllm_simd::vload(p); }
PAGEDLLM_INLINE pagedllm_simd::VecF load8(const c10::Float8_e4m3fn* p) {
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80))))};
}

// Softmax numerators of s[0, n) in place. Returns 1 / sum.
inline float softmax_vec(float* s, int64_t n) {
  using namespace pagedllm_simd;
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kVecWidth) {
    VecF mv = vset1(mx);
    for (; i + kVecWidth <= n; i += kVecWidth) mv = vmax(mv, vload(s + i));
    mx = vreduce_max(mv);
  }
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  const VecF vmx = vset1(mx);
  VecF sv = vset1(0.f);
  float sum = 0.f;
  for (i = 0; i + kVecWidth <= n; i += kVecWidth) {
    const VecF e = vexp(vload(s + i) - vmx);
    vstore(s + i, e);
    sv = sv + e;
  }
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return 1.f / (vreduce_add(sv) + sum);
}

// Scores one key row at a time (each K vector, widened once, feeds the G query heads), then
// the values a tile of 16 rows at a time with the G accumulators of a vector in registers.
template <typename T, typename C, int G>
void attend_vec(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) {
  using namespace pagedllm_simd;
  constexpr int64_t kW = kVecWidth;
  const int64_t D = p.head_dim, cap = w.cap, n = wk.n, h = wk.h;
  float *scores = w.scores, *acc = w.acc, *qf = w.q;
  const VecF scale = vset1(p.scale * p.k_scale * kRowLoadFactor<C>);
  for (int g = 0; g < G; ++g) {
    const T* q = x.q + wk.token(g) * p.q_sb + wk.head(p, g) * p.q_sh;
    for (int64_t c = 0; c < D; c += kW) vstore(qf + g * D + c, vload(q + c) * scale);
  }

  RowCursor<C> keys(p, x.block_table, wk.table_row(), x.k + h * p.k_sh, p.k_sb, p.k_st, n);
  for (int64_t t = 0; t < n; ++t) {
    const C* k = keys.next();
    VecF a[G];
    for (int g = 0; g < G; ++g) a[g] = vset1(0.f);
    for (int64_t c = 0; c < D; c += kW) {
      const VecF kv = load8(k + c);
      for (int g = 0; g < G; ++g) a[g] = vfmadd(vload(qf + g * D + c), kv, a[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * cap + t] = vreduce_add(a[g]);
  }

  RowCursor<C> values(p, x.block_table, wk.table_row(), x.v + h * p.v_sh, p.v_sb, p.v_st, n);
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {  // each member over its own length; weight 0 past it
    const int64_t len = wk.len(g);
    inv_sum[g] = softmax_vec(scores + g * cap, len) * p.v_scale * kRowLoadFactor<C>;
    std::fill(scores + g * cap + len, scores + g * cap + n, 0.f);
  }
  std::fill(acc, acc + G * D, 0.f);
  const C* rows[kTile];
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    for (int j = 0; j < cnt; ++j) rows[j] = values.next();
    for (int64_t c = 0; c < D; c += kW) {
      VecF a[G];
      for (int g = 0; g < G; ++g) a[g] = vload(acc + g * D + c);
      for (int j = 0; j < cnt; ++j) {
        const VecF vv = load8(rows[j] + c);
        for (int g = 0; g < G; ++g) a[g] = vfmadd(vset1(scores[g * cap + t0 + j]), vv, a[g]);
      }
      for (int g = 0; g < G; ++g) vstore(acc + g * D + c, a[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    T* o = x.o + wk.token(g) * p.o_sb + wk.head(p, g) * p.o_sh;
    const VecF inv = vset1(inv_sum[g]);
    for (int64_t c = 0; c < D; c += kW) vstore(o + c, vload(acc + g * D + c) * inv);
  }
}
#endif

template <typename T, typename C>
using AttendFn = void (*)(const Params&, const Ptrs<T, C>&, const Work&, const Scratch&);

// Kernels by sub-group size (index 1..kMaxGroup); all entries portable when the vector path
// does not apply.
template <typename T, typename C>
struct Kernels {
  AttendFn<T, C> by_group[kMaxGroup + 1];
  bool vector;
};

// The vector path of this build, as attend<T, G> for G = 1..kMaxGroup, and its vector width.
#if defined(PAGEDLLM_AVX512)
template <typename T, typename C, int G>
void attend_vector(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) { attend_avx512<T, C, G>(p, x, wk, w); }
constexpr int64_t kVectorWidth = 16;
#elif defined(PAGEDLLM_VEC)
template <typename T, typename C, int G>
void attend_vector(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w) { attend_vec<T, C, G>(p, x, wk, w); }
constexpr int64_t kVectorWidth = pagedllm_simd::kVecWidth;
#endif

template <typename T, typename C>
Kernels<T, C> pick_kernels(const Params& p, bool force_portable) {
  Kernels<T, C> k;
  k.vector = false;
  for (auto& f : k.by_group) f = attend_portable<T, C>;
#if defined(PAGEDLLM_AVX512) || defined(PAGEDLLM_VEC)
  if (!force_portable && p.head_dim % kVectorWidth == 0 && p.head_dim <= kMaxVecDim) {
    k.vector = true;
    k.by_group[1] = attend_vector<T, C, 1>;
    k.by_group[2] = attend_vector<T, C, 2>;
    k.by_group[3] = attend_vector<T, C, 3>;
    k.by_group[4] = attend_vector<T, C, 4>;
    k.by_group[5] = attend_vector<T, C, 5>;
    k.by_group[6] = attend_vector<T, C, 6>;
    k.by_group[7] = attend_vector<T, C, 7>;
    k.by_group[8] = attend_vector<T, C, 8>;
  }
#else
  (void)p;
  (void)force_portable;
#endif
  return k;
}

// Whether query token a + 1 continues token a's run (see the header): one more token over
// the same context, its block table equal to a's over the blocks a reads.
inline bool continues_run(const Params& p, const int64_t* block_table, const int64_t* seq_lens, int64_t a) {
  const int64_t n = seq_lens[a * p.sl_s0], next = seq_lens[(a + 1) * p.sl_s0];
  if (n < 1 || next != n + 1 || next > p.max_blocks * p.block_size) return false;
  const int64_t used = (n + p.block_size - 1) / p.block_size;
  for (int64_t i = 0; i < used; ++i)
    if (block_table[a * p.bt_s0 + i * p.bt_s1] != block_table[(a + 1) * p.bt_s0 + i * p.bt_s1]) return false;
  return true;
}

template <typename T, typename C>
void run(const Params& p, const Ptrs<T, C>& x, bool force_portable, bool runs) {
  const Kernels<T, C> kernels = pick_kernels<T, C>(p, force_portable);
  // Query-head sub-groups: the whole group on the portable path; on the vector path at most
  // kMaxGroup, split evenly (G = 10 -> 5 + 5).
  const int64_t num_sub = kernels.vector ? (p.group + kMaxGroup - 1) / kMaxGroup : 1;
  const int64_t sub = (p.group + num_sub - 1) / num_sub;
  // Runs of query tokens over one context, up to kMaxGroup heads in all (vector path, whole
  // groups only): [start, start + length) per run. Without ``runs`` (the per-token variant)
  // every token is a run of its own.
  const int64_t max_run = runs && kernels.vector && num_sub == 1 ? kMaxGroup / p.group : 1;
  std::vector<int64_t> run_start;
  run_start.reserve(p.batch + 1);
  for (int64_t b = 0; b < p.batch;) {
    run_start.push_back(b);
    int64_t length = 1;
    while (length < max_run && b + length < p.batch && continues_run(p, x.block_table, x.seq_lens, b + length - 1))
      ++length;
    b += length;
  }
  const int64_t num_runs = static_cast<int64_t>(run_start.size());
  run_start.push_back(p.batch);
  // Items: whole runs when there are enough to balance the threads, else (run, kv head).
  const int64_t threads = std::max(at::get_num_threads(), 1);
  const int64_t heads_per_item = num_runs >= 4 * threads ? p.num_kv_heads : 1;
  const int64_t items_per_run = p.num_kv_heads / heads_per_item;
  const int64_t total = num_runs * items_per_run;
  const int64_t cap = round_up(std::max<int64_t>(p.max_blocks * p.block_size, kTile), 32);
  const int64_t num_tasks = std::min<int64_t>(threads, total);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) {
    const int64_t G = sub * max_run, gd = round_up(G * p.head_dim, 16);
    const int64_t sizes[] = {G * cap, G * cap / 2, gd, gd, p.head_dim, G};
    int64_t total_floats = 16;
    for (int64_t s : sizes) total_floats += round_up(s, 16);
    std::vector<float> buf(total_floats);
    float* ptr = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    float* parts[6];
    for (int i = 0; i < 6; ++i) {
      parts[i] = ptr;
      ptr += round_up(sizes[i], 16);
    }
    const Scratch w{parts[0], cap, reinterpret_cast<uint16_t*>(parts[1]), parts[2], parts[3], parts[4], parts[5]};
    for (;;) {
      const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
      if (item >= total) break;
      const int64_t r = item / items_per_run, h0 = item % items_per_run * heads_per_item;
      const int64_t b = run_start[r], tokens = run_start[r + 1] - b, last = b + tokens - 1;
      const int64_t n = x.seq_lens[last * p.sl_s0];
      TORCH_CHECK(n >= 0 && n <= p.max_blocks * p.block_size, "paged_decode_attention: seq_len ", n, " of request ",
                  last, " exceeds its block table (", p.max_blocks, " blocks of ", p.block_size, ")");
      for (int64_t h = h0; h < h0 + heads_per_item; ++h) {
        if (n == 0) {  // (a run's tokens have n >= 1)
          for (int64_t g = 0; g < p.group; ++g) {
            T* o = x.o + b * p.o_sb + (h * p.group + g) * p.o_sh;
            std::fill(o, o + p.head_dim, static_cast<T>(0.f));
          }
          continue;
        }
        for (int64_t g0 = 0; g0 < p.group; g0 += sub) {
          const int64_t count = std::min(sub, p.group - g0);
          const Work wk{b, h, g0, count, n, tokens};
          kernels.by_group[kernels.vector ? count * tokens : 0](p, x, wk, w);
        }
      }
    }
  });
}

// run<T, C> for query dtype T and the caches' dtype (T or float8).
template <typename T>
void run_cache(const Params& p, at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
               bool force_portable, bool runs) {
  const auto go = [&](auto cache_tag) {
    using C = decltype(cache_tag);
    run<T, C>(p,
              Ptrs<T, C>{query.const_data_ptr<T>(), out.mutable_data_ptr<T>(), key_cache.const_data_ptr<C>(),
                         value_cache.const_data_ptr<C>(), block_table.const_data_ptr<int64_t>(),
                         seq_lens.const_data_ptr<int64_t>()},
              force_portable, runs);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn: go(c10::Float8_e4m3fn()); break;
    case at::kFloat8_e5m2: go(c10::Float8_e5m2()); break;
    default: go(T()); break;
  }
}

void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                           double scale, double k_scale, double v_scale, bool force_portable, bool runs) {
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu() && block_table.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_decode_attention: all tensors must be on CPU");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [B, Hq, D]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  TORCH_CHECK(out.sizes() == query.sizes(), "out and query shapes differ");
  const auto dtype = query.scalar_type();
  const auto cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && value_cache.scalar_type() == cache_dtype &&
                  (cache_dtype == dtype || cache_dtype == at::kFloat8_e4m3fn || cache_dtype == at::kFloat8_e5m2),
              "query and out must have one dtype, and key_cache and value_cache that dtype or one float8 dtype "
              "(float8_e4m3fn, float8_e5m2)");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.dim() == 2 && seq_lens.dim() == 1, "block_table [B, max_blocks], seq_lens [B]");

  Params p;
  p.batch = query.size(0);
  p.num_heads = query.size(1);
  p.head_dim = query.size(2);
  p.num_blocks = key_cache.size(0);
  p.block_size = key_cache.size(1);
  p.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == p.head_dim, "head_dim of query and caches differ");
  TORCH_CHECK(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.size(0) == p.batch && seq_lens.size(0) == p.batch, "block_table / seq_lens batch differs");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "head_dim must be contiguous in query, out and caches");
  TORCH_CHECK(p.block_size > 0, "block_size must be positive");
  p.group = p.num_heads / p.num_kv_heads;
  p.max_blocks = block_table.size(1);
  p.q_sb = query.stride(0);
  p.q_sh = query.stride(1);
  p.o_sb = out.stride(0);
  p.o_sh = out.stride(1);
  p.k_sb = key_cache.stride(0);
  p.k_st = key_cache.stride(1);
  p.k_sh = key_cache.stride(2);
  p.v_sb = value_cache.stride(0);
  p.v_st = value_cache.stride(1);
  p.v_sh = value_cache.stride(2);
  p.bt_s0 = block_table.stride(0);
  p.bt_s1 = block_table.stride(1);
  p.sl_s0 = seq_lens.stride(0);
  p.scale = static_cast<float>(scale);
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  if (p.batch == 0 || p.num_heads == 0) return;
  switch (dtype) {
    case at::kFloat: run_cache<float>(p, out, query, key_cache, value_cache, block_table, seq_lens, force_portable, runs); break;
    case at::kBFloat16: run_cache<c10::BFloat16>(p, out, query, key_cache, value_cache, block_table, seq_lens, force_portable, runs); break;
    case at::kHalf: run_cache<c10::Half>(p, out, query, key_cache, value_cache, block_table, seq_lens, force_portable, runs); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", dtype);
  }
}

void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, double k_scale, double v_scale) {
  decode_attention_impl(out, query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, false, true);
}

// The same with every query token computed alone (no runs): a token's output is then the
// same whichever tokens share the call (--batch-invariant).
void paged_decode_attention_per_token(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_table,
                                      const at::Tensor& seq_lens, double scale, double k_scale, double v_scale) {
  decode_attention_impl(out, query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, false, false);
}

// The same with the portable loops whatever the build, to test them on any machine.
void paged_decode_attention_portable(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_table,
                                     const at::Tensor& seq_lens, double scale, double k_scale, double v_scale) {
  decode_attention_impl(out, query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, true, true);
}

// ---------------------------------------------------------------------------------------------
// Cache writes: write_kv_cache(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)
// stores token t's key [Hkv, D] and value in slot slot_mapping[t] (block slot / block_size, offset
// slot % block_size) of caches [num_blocks, block_size, Hkv, D] (any strides, D contiguous).
// Caches of the key's dtype get a copy; float8 caches get x / scale (float32 division) rounded to
// nearest even and saturated at the format's largest value, NaN kept: the bytes that
// torch's (x.float() / scale).clamp(-max, max).to(float8) gives.

// The FP8 bits of x (float32 in the format's range [-max, max], or NaN), round to nearest even,
// without branches so the loops vectorize. kMantissa bits are kept; normal numbers drop the
// other 23 - kMantissa with rounding carried into the exponent, rebiased by 127 - kBias;
// below the smallest normal 2^(1 - kBias), |x| + 2^(24 - kBias - kMantissa) rounds |x| to the
// subnormal step 2^(1 - kBias - kMantissa) in float32 and its low bits count the steps. NaN
// -> 0x7f with the sign, as c10's conversions.
template <int kMantissa, int kBias>
inline uint8_t fp8_bits(float x) {
  constexpr int kDrop = 23 - kMantissa;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kBias) << 23;  // 2^(1 - kBias)
  constexpr float kMagic = static_cast<float>(1u << (24 - kBias - kMantissa));  // float32 step there: the FP8 one
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t sign = (u >> 24) & 0x80u, magnitude = u & 0x7fffffffu;
  const uint32_t normal = ((magnitude + ((1u << (kDrop - 1)) - 1) + ((magnitude >> kDrop) & 1u)) >> kDrop) -
                          (static_cast<uint32_t>(127 - kBias) << kMantissa);
  float absolute, shifted;
  std::memcpy(&absolute, &magnitude, sizeof(absolute));
  shifted = absolute + kMagic;
  uint32_t shifted_bits, magic_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const float magic = kMagic;
  std::memcpy(&magic_bits, &magic, sizeof(magic_bits));
  const uint32_t subnormal = shifted_bits - magic_bits;
  uint32_t bits = magnitude < kMinNormal ? subnormal : normal;
  bits = magnitude > 0x7f800000u ? 0x7fu : bits;
  return static_cast<uint8_t>(bits | sign);
}

template <typename C>
inline C to_cache(float x, float scale) {
  if constexpr (std::is_same<C, c10::Float8_e4m3fn>::value) {
    return C(fp8_bits<3, 7>(std::clamp(x / scale, -448.f, 448.f)), C::from_bits());
  } else if constexpr (std::is_same<C, c10::Float8_e5m2>::value) {
    return C(fp8_bits<2, 15>(std::clamp(x / scale, -57344.f, 57344.f)), C::from_bits());
  } else {
    return static_cast<C>(x);
  }
}

template <typename T, typename C>
void write_rows(at::Tensor& cache, const at::Tensor& x, const int64_t* slots, int64_t num_tokens, float scale) {
  const int64_t block_size = cache.size(1), heads = cache.size(2), D = cache.size(3);
  const int64_t num_slots = cache.size(0) * block_size;
  C* dst = cache.mutable_data_ptr<C>();
  const T* src = x.const_data_ptr<T>();
  const int64_t c_sb = cache.stride(0), c_st = cache.stride(1), c_sh = cache.stride(2);
  const int64_t x_st = x.stride(0), x_sh = x.stride(1);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "write_kv_cache: slot ", slot, " of token ", t, " out of range [0, ",
                  num_slots, ")");
      C* row = dst + slot / block_size * c_sb + slot % block_size * c_st;
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = src + t * x_st + h * x_sh;
        C* out = row + h * c_sh;
        if constexpr (std::is_same<C, T>::value) {
          std::memcpy(out, in, D * sizeof(T));
        } else {
          for (int64_t d = 0; d < D; ++d) out[d] = to_cache<C>(static_cast<float>(in[d]), scale);
        }
      }
    }
  });
}

template <typename T>
void write_both(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
                const int64_t* slots, int64_t num_tokens, float k_scale, float v_scale) {
  const auto go = [&](auto cache_tag) {
    using C = decltype(cache_tag);
    write_rows<T, C>(key_cache, key, slots, num_tokens, k_scale);
    write_rows<T, C>(value_cache, value, slots, num_tokens, v_scale);
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn: go(c10::Float8_e4m3fn()); break;
    case at::kFloat8_e5m2: go(c10::Float8_e5m2()); break;
    default: go(T()); break;
  }
}

void write_kv_cache(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu() && key.device().is_cpu() &&
                  value.device().is_cpu() && slot_mapping.device().is_cpu(),
              "write_kv_cache: all tensors must be on CPU");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "write_kv_cache: caches must be [num_blocks, block_size, Hkv, D], both of one shape");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == key_cache.size(2) &&
                  key.size(2) == key_cache.size(3),
              "write_kv_cache: key and value must be [num_tokens, Hkv, D] of the caches' Hkv and D");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "write_kv_cache: slot_mapping must be [num_tokens] contiguous int64");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "write_kv_cache: head_dim must be contiguous");
  const auto dtype = key.scalar_type(), cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(value.scalar_type() == dtype && value_cache.scalar_type() == cache_dtype &&
                  (cache_dtype == dtype || cache_dtype == at::kFloat8_e4m3fn || cache_dtype == at::kFloat8_e5m2),
              "write_kv_cache: key and value must have one dtype, and the caches that dtype or one float8 dtype "
              "(float8_e4m3fn, float8_e5m2)");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t n = key.size(0);
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  switch (dtype) {
    case at::kFloat: write_both<float>(key_cache, value_cache, key, value, slots, n, ks, vs); break;
    case at::kBFloat16: write_both<c10::BFloat16>(key_cache, value_cache, key, value, slots, n, ks, vs); break;
    case at::kHalf: write_both<c10::Half>(key_cache, value_cache, key, value, slots, n, ks, vs); break;
    default: TORCH_CHECK(false, "write_kv_cache: unsupported dtype ", dtype);
  }
}

// Which instruction-set level this build was compiled for (a name of pagedllm/kernels/isa.py),
// for tests and logs.
std::string build_info() {
#if defined(__AVX512BF16__)
  std::string s = "avx512_bf16";
#elif defined(__AVX512F__)
  std::string s = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  std::string s = "avx2";
#else
  std::string s = "portable";
#endif
#ifdef _OPENMP
  s += ",openmp";
#endif
  return s;
}

}  // namespace

PAGEDLLM_LIBRARY(m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, float k_scale, float v_scale) -> ()");
  m.def("paged_decode_attention_portable(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, float k_scale, float v_scale) -> ()");
  m.def("paged_decode_attention_per_token(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, float k_scale, float v_scale) -> ()");
  m.def("write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping, "
        "float k_scale, float v_scale) -> ()");
  m.def("build_info() -> str", &build_info);
}

PAGEDLLM_IMPL(CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_portable", &paged_decode_attention_portable);
  m.impl("paged_decode_attention_per_token", &paged_decode_attention_per_token);
  m.impl("write_kv_cache", &write_kv_cache);
}
