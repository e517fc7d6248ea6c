// Paged decode attention for CPU: what its files share.
//
//   paged_attention.cpp           the operators: input checks, runs of tokens, work over threads
//   paged_attention_portable.cpp  the portable kernel (plain loops)
//   paged_attention_vec.cpp       the vector kernel, written once over simd.h's VecF, with the
//                                 steps each ISA does its own way in paged_attention_avx512.h
//                                 and paged_attention_avx2.h
//
// A kernel computes one Work item (the query heads of one kv head, over one context) into the
// output; its scratch comes from the caller, one Scratch per thread.
//
// The softmax's variants (Params): a sliding window W (a query at position i attends keys
// i - W + 1 .. i: the rows before are never read, the blocks wholly before them not even
// looked up) or chunked local attention of C tokens (keys i - i % C .. i, the query's aligned
// chunk, Llama 4: the same, from the chunk's start), logits soft-capping (score = cap * tanh(score / cap), Gemma 2) and attention
// sinks (a logit per query head that joins the softmax's denominator only, gpt-oss). Each is
// decided once per Work item member, outside the loops over rows.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "library.h"

namespace pagedllm_attention PAGEDLLM_HIDDEN {

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
  int64_t window;          // sliding window in tokens; 0: the whole context
  int64_t chunk;           // chunked local attention in tokens (window 0 then); 0: none
  float soft_cap;          // logits soft cap; 0: none
  const float* sinks;      // [num_heads] sink logits (contiguous float32); nullptr: none
};

// The first position a query of context length n (at position n - 1) attends to.
inline int64_t window_start(const Params& p, int64_t n) {
  if (p.chunk > 0) return n > 0 ? (n - 1) - (n - 1) % p.chunk : 0;
  return p.window > 0 && n > p.window ? n - p.window : 0;
}

// Query head hq's sink logit; -inf without sinks (then exp(sink - max) adds exactly 0).
inline float sink_logit(const Params& p, int64_t hq) {
  return p.sinks != nullptr ? p.sinks[hq] : -std::numeric_limits<float>::infinity();
}

// T: query and output; C: the cache (T, or float8 e4m3 / e5m2).
template <typename T, typename C>
struct Ptrs {
  const T* q;
  T* o;
  const C* k;
  const C* v;
  const int64_t* block_table;
  const int64_t* seq_lens;
  // [B] (stride we_s0): the position + 1 a query's sliding window ends at, where it sees keys
  // past itself (a bidirectional image span: seq_len is the span's end); nullptr: seq_lens.
  const int64_t* window_ends;
  int64_t we_s0;
};

// Token b's window end (see Ptrs::window_ends): its seq_len n unless given.
template <typename T, typename C>
inline int64_t window_end(const Ptrs<T, C>& x, int64_t b, int64_t n) {
  return x.window_ends != nullptr ? x.window_ends[b * x.we_s0] : n;
}

// Per-thread scratch (64-byte aligned parts): scores [group][cap] float (cap >= every seq_len
// rounded up to the tile, plus a tile with a sliding window; a multiple of 32), weights16 [group][cap] 16-bit, acc
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

// The rows of one kv head of one request, in token order from token `first` (< n): walks the
// block table from first's block (the entries before it are never read; checking each block
// id it reads) and prefetches the rows of the block kPrefetchTokens ahead. Constructing it
// prefetches the first blocks.
template <typename T>
class RowCursor {
 public:
  RowCursor(const Params& p, const int64_t* block_table, int64_t b, const T* head, int64_t stride_block,
            int64_t stride_token, int64_t first, int64_t n)
      : p_(p), block_table_(block_table), b_(b), head_(head), stride_block_(stride_block),
        stride_token_(stride_token), num_seq_blocks_((n + p.block_size - 1) / p.block_size),
        ahead_(std::max<int64_t>(1, (kPrefetchTokens + p.block_size - 1) / p.block_size)),
        row_bytes_(p.head_dim * static_cast<int64_t>(sizeof(T))), index_(first / p.block_size - 1),
        off_(p.block_size) {
    for (int64_t i = index_ + 1; i <= index_ + ahead_; ++i) prefetch_block(i);
    if (first % p.block_size != 0) {
      next_block();
      off_ = first % p.block_size;
    }
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
  int64_t index_;
  int64_t off_;
  const T* base_ = nullptr;
};

alignas(64) inline constexpr float kZeroRow[kMaxVecDim] = {};  // stands in for the rows past seq_len

// Hands `lead` rows of kZeroRow (zeros of any type) then the next n rows of a cursor to f kTile
// at a time, as f(rows, cnt, t0): rows[j] is row t0 + j of those lead + n for j < cnt, and
// kZeroRow past them.
template <typename C, typename F>
PAGEDLLM_INLINE void for_each_tile(RowCursor<C>& cursor, int64_t lead, int64_t n, F&& f) {
  const C* zero_row = reinterpret_cast<const C*>(kZeroRow);
  const C* rows[kTile];
  const int64_t total = lead + n;
  for (int64_t t0 = 0; t0 < total; t0 += kTile) {
    const int cnt = static_cast<int>(std::min<int64_t>(kTile, total - t0));
    const int skip = static_cast<int>(std::min<int64_t>(std::max<int64_t>(lead - t0, 0), cnt));
    int j = 0;
    for (; j < skip; ++j) rows[j] = zero_row;
    for (; j < cnt; ++j) rows[j] = cursor.next();
    for (; j < kTile; ++j) rows[j] = zero_row;
    f(rows, cnt, t0);
  }
}

// Query heads [h * group + g0, h * group + g0 + count) of query tokens b .. b + tokens - 1
// (one context: a run, see paged_attention.cpp) against kv head h; n is the last token's
// length (token j's is n - (tokens - 1 - j)), and the last token's block table row is read;
// win is the last token's window end (n, except for a single token whose keys reach past it).
// Member i of the G = count x tokens computed together is head g0 + i % count of token
// b + i / count.
struct Work {
  int64_t b, h, g0, count, n, tokens, win;

  int64_t token(int64_t i) const { return b + i / count; }
  int64_t head(const Params& p, int64_t i) const { return h * p.group + g0 + i % count; }
  int64_t len(int64_t i) const { return n - (tokens - 1 - i / count); }
  int64_t start(const Params& p, int64_t i) const { return window_start(p, len(i) - (n - win)); }
  int64_t table_row() const { return b + tokens - 1; }
};

// One kernel: computes the output rows of wk.
template <typename T, typename C>
using AttendFn = void (*)(const Params&, const Ptrs<T, C>&, const Work&, const Scratch&);

// The plain loops: any head_dim, single query tokens (wk.tokens == 1), the whole group at once.
template <typename T, typename C>
void attend_portable(const Params& p, const Ptrs<T, C>& x, const Work& wk, const Scratch& w);

// Whether this build's vector kernel takes head_dim (a multiple of simd.h's kVecWidth, at most
// kMaxVecDim; never in portable builds); if so, by_group[G] is set to it for G = 1..kMaxGroup
// members (by_group[0] is left as it is).
template <typename T, typename C>
bool vector_kernels(int64_t head_dim, AttendFn<T, C>* by_group);

// The (query, cache) dtypes the operators take, for the kernels' explicit instantiations.
#define PAGEDLLM_ATTENTION_DTYPES(X)                                                        \
  X(float, float) X(float, c10::Float8_e4m3fn) X(float, c10::Float8_e5m2)                   \
  X(c10::BFloat16, c10::BFloat16) X(c10::BFloat16, c10::Float8_e4m3fn)                      \
  X(c10::BFloat16, c10::Float8_e5m2) X(c10::Half, c10::Half) X(c10::Half, c10::Float8_e4m3fn) \
  X(c10::Half, c10::Float8_e5m2)

}  // namespace pagedllm_attention
