// KV cache writes for CPU: write_kv_cache(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)
// stores token t's key [Hkv, D] and value in slot slot_mapping[t] (block slot / block_size, offset
// slot % block_size) of caches [num_blocks, block_size, Hkv, D] (any strides, D contiguous).
// Caches of the key's dtype get a copy; float8 caches get x / scale (float32 division) rounded to
// nearest even and saturated at the format's largest value, NaN kept: the bytes that
// torch's (x.float() / scale).clamp(-max, max).to(float8) gives.
//
// Registered as torch.ops.pagedllm_cpu_<level>.write_kv_cache (see __init__.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fp8_quant.h"
#include "library.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {
using pagedllm_fp8::to_cache;

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
}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping, "
        "float k_scale, float v_scale) -> ()");
}

PAGEDLLM_IMPL(CPU, m) { m.impl("write_kv_cache", &write_kv_cache); }
