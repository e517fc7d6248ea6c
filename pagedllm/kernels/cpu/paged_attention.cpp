// Paged decode attention for CPU: one query token per request, K/V read from the paged cache.
//
// Registered as the operator torch.ops.pagedllm_cpu_<level>.paged_decode_attention (see __init__.py,
// which builds these files with torch.utils.cpp_extension.load on first use).
//
//   out         [B, Hq, D]                          written in place, dtype of query
//   query       [B, Hq, D]
//   key_cache   [num_blocks, block_size, Hkv, D]    (kv_cache[0]; any strides, D contiguous)
//   value_cache [num_blocks, block_size, Hkv, D]    (kv_cache[1])
//   block_table [B, max_blocks] int64
//   seq_lens    [B] int64, context length including the new token; cache positions
//               >= seq_len are never read.
//   k_scale, v_scale  FP8 caches: K = k_scale * stored key, V = v_scale * stored value (1 otherwise).
//   sliding_window    W > 0: the query at position n - 1 attends positions max(0, n - W) .. n - 1
//                     only (the blocks wholly before them are not looked up: their block-table
//                     entries may hold any id); 0: its whole context.
//   attention_chunk_size  C > 0: the query at position n - 1 attends positions (n - 1) - (n - 1) % C
//                     .. n - 1 only, its aligned chunk (Llama 4; the blocks before are not looked
//                     up); 0: none. Not with sliding_window.
//   logits_soft_cap   cap > 0: scores become cap * tanh(score / cap) before the softmax (Gemma 2);
//                     0: none.
//   sinks             [Hq] float32 or None: a logit per query head that joins the softmax's
//                     denominator only (out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j
//                     e^(s_j - m)), gpt-oss).
//   window_ends       [B] int64 or None: where a query sees keys past itself (a bidirectional
//                     image span, Gemma 3: seq_len is then the span's end), its position + 1,
//                     at which its sliding window ends (it attends max(0, e - W) .. n - 1);
//                     such a token is computed alone. None: every token's is its seq_len.
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
// The kernels (paged_attention.h): the vector kernel (paged_attention_vec.cpp; head_dim % 16 == 0
// in AVX-512 builds, % 8 == 0 in AVX2 builds, head_dim <= 256), else the portable loops
// (paged_attention_portable.cpp: any other shape, or portable builds).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"
#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

namespace {
using namespace pagedllm_attention;

// Kernels by sub-group size (index 1..kMaxGroup); all entries portable when the vector path
// does not apply.
template <typename T, typename C>
struct Kernels {
  AttendFn<T, C> by_group[kMaxGroup + 1];
  bool vector;
};

template <typename T, typename C>
Kernels<T, C> pick_kernels(const Params& p, bool force_portable) {
  Kernels<T, C> k;
  for (auto& f : k.by_group) f = attend_portable<T, C>;
  k.vector = !force_portable && vector_kernels<T, C>(p.head_dim, k.by_group);
  return k;
}

// Whether query token a + 1 continues token a's run (see the header): one more token over
// the same context, its block table equal to a's over the blocks a reads from the run's first
// block `from` (the first block its first token's window reads).
template <typename T, typename C>
inline bool continues_run(const Params& p, const Ptrs<T, C>& x, int64_t a, int64_t from) {
  const int64_t* block_table = x.block_table;
  const int64_t n = x.seq_lens[a * p.sl_s0], next = x.seq_lens[(a + 1) * p.sl_s0];
  if (n < 1 || next != n + 1 || next > p.max_blocks * p.block_size) return false;
  // A token whose keys reach past it (its window end is not its length) is computed alone.
  if (window_end(x, a, n) != n || window_end(x, a + 1, next) != next) return false;
  const int64_t used = (n + p.block_size - 1) / p.block_size;
  for (int64_t i = from; i < used; ++i)
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
    const int64_t n = std::max<int64_t>(x.seq_lens[b * p.sl_s0], 0);
    const int64_t from = window_start(p, std::min(window_end(x, b, n), n)) / p.block_size;
    while (length < max_run && b + length < p.batch && continues_run(p, x, b + length - 1, from))
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
  // (With a window or a chunk, a member's softmax starts past the row's start, and AVX-512's writes up to a tile
  // past its end.)
  const int64_t local = p.window > 0 || p.chunk > 0 ? kTile : 0;
  const int64_t cap = round_up(std::max<int64_t>(p.max_blocks * p.block_size, kTile) + local, 32);
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
      const int64_t win = window_end(x, last, n);
      TORCH_CHECK(win <= n && (win >= 1 || n == 0), "paged_decode_attention: window_end ", win, " of request ", last,
                  " must be in 1 .. its seq_len ", n);
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
          const Work wk{b, h, g0, count, n, tokens, win};
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
               const std::optional<at::Tensor>& window_ends, bool force_portable, bool runs) {
  const auto go = [&](auto cache_tag) {
    using C = decltype(cache_tag);
    run<T, C>(p,
              Ptrs<T, C>{query.const_data_ptr<T>(), out.mutable_data_ptr<T>(), key_cache.const_data_ptr<C>(),
                         value_cache.const_data_ptr<C>(), block_table.const_data_ptr<int64_t>(),
                         seq_lens.const_data_ptr<int64_t>(),
                         window_ends.has_value() ? window_ends->const_data_ptr<int64_t>() : nullptr,
                         window_ends.has_value() ? window_ends->stride(0) : 0},
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
                           double scale, double k_scale, double v_scale, int64_t sliding_window,
                           double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                           int64_t attention_chunk_size, const std::optional<at::Tensor>& window_ends,
                           bool force_portable, bool runs) {
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
  TORCH_CHECK(sliding_window >= 0, "paged_decode_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(attention_chunk_size >= 0, "paged_decode_attention: attention_chunk_size must be >= 0 (0: none), got ",
              attention_chunk_size);
  TORCH_CHECK(attention_chunk_size == 0 || sliding_window == 0,
              "paged_decode_attention: sliding_window and attention_chunk_size cannot both be set");
  TORCH_CHECK(logits_soft_cap >= 0, "paged_decode_attention: logits_soft_cap must be >= 0 (0: none), got ",
              logits_soft_cap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == query.size(1) && sinks->is_contiguous(),
                "paged_decode_attention: sinks must be a contiguous float32 CPU tensor [num_heads] (", query.size(1),
                "), got ", sinks->scalar_type(), " ", sinks->sizes());
  }

  if (window_ends.has_value()) {
    TORCH_CHECK(window_ends->device().is_cpu() && window_ends->scalar_type() == at::kLong && window_ends->dim() == 1 &&
                    window_ends->size(0) == query.size(0),
                "paged_decode_attention: window_ends must be an int64 CPU tensor [B] (", query.size(0), "), got ",
                window_ends->scalar_type(), " ", window_ends->sizes());
  }

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
  p.window = sliding_window;
  p.chunk = attention_chunk_size;
  p.soft_cap = static_cast<float>(logits_soft_cap);
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  if (p.batch == 0 || p.num_heads == 0) return;
  switch (dtype) {
    case at::kFloat: run_cache<float>(p, out, query, key_cache, value_cache, block_table, seq_lens, window_ends, force_portable, runs); break;
    case at::kBFloat16: run_cache<c10::BFloat16>(p, out, query, key_cache, value_cache, block_table, seq_lens, window_ends, force_portable, runs); break;
    case at::kHalf: run_cache<c10::Half>(p, out, query, key_cache, value_cache, block_table, seq_lens, window_ends, force_portable, runs); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", dtype);
  }
}

// The operators: kPortable runs the portable loops whatever the build (to test them on any
// machine); without kRuns every query token is computed alone, so that its output is the same
// whichever tokens share the call (--batch-invariant: paged_decode_attention_per_token).
template <bool kPortable, bool kRuns>
void decode_attention_op(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                         double scale, double k_scale, double v_scale, int64_t sliding_window, double logits_soft_cap,
                         const std::optional<at::Tensor>& sinks, int64_t attention_chunk_size,
                         const std::optional<at::Tensor>& window_ends) {
  decode_attention_impl(out, query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale,
                        sliding_window, logits_soft_cap, sinks, attention_chunk_size, window_ends, kPortable, kRuns);
}

}  // namespace

#define PAGEDLLM_DECODE_SCHEMA                                                                                \
  "(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, " \
  "float scale, float k_scale, float v_scale, int sliding_window=0, float logits_soft_cap=0., "               \
  "Tensor? sinks=None, int attention_chunk_size=0, Tensor? window_ends=None) -> ()"

PAGEDLLM_FRAGMENT(m) {
  m.def("paged_decode_attention" PAGEDLLM_DECODE_SCHEMA);
  m.def("paged_decode_attention_portable" PAGEDLLM_DECODE_SCHEMA);
  m.def("paged_decode_attention_per_token" PAGEDLLM_DECODE_SCHEMA);
}

PAGEDLLM_IMPL(CPU, m) {
  m.impl("paged_decode_attention", &decode_attention_op<false, true>);
  m.impl("paged_decode_attention_portable", &decode_attention_op<true, true>);
  m.impl("paged_decode_attention_per_token", &decode_attention_op<false, false>);
}
