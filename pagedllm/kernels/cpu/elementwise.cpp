// Fused per-token kernels of a Llama-style layer for CPU: RMSNorm (alone and with the
// residual add), SwiGLU and the rotary embedding, each one pass over memory.
//
// Registered beside the attention kernel as torch.ops.pagedllm_cpu_<level>.* (see __init__.py).
// Every kernel computes in float32 and rounds to the tensor dtype exactly where Hugging Face
// transformers' PyTorch code rounds, so bfloat16 results are bit-identical to it, except
// RMSNorm's float32 mean of squares, whose summation order differs (see rms_row):
//
//   rms_norm            out = weight * to_dtype(x * rsqrt(mean(x^2) + eps))         (LlamaRMSNorm)
//   fused_add_rms_norm  residual = to_dtype(x + residual); x = rms_norm(residual)   (in place)
//   silu_and_mul        out = to_dtype(to_dtype(silu(gate)) * up), x = [gate | up]  (LlamaMLP)
//   rotary_embedding    x = to_dtype(to_dtype(x * cos) + to_dtype(rotate_half(x) * sin)), q and k
//                       in place, cos / sin [T, D] in the model dtype (neox layout: halves)
//
// Rows are split over ATen's thread pool with a grain of about 32k elements, so the small
// tensors of a decode step run on the calling thread without waking the pool.
//
// Vector path (AVX-512 and AVX2 builds; simd.h): 16 or 8 floats at a time; bfloat16 is
// widened by a shift and narrowed with round-to-nearest-even, float16 through F16C. exp() is
// Cephes' expf polynomial (about 1 ulp in float32, as PyTorch's Sleef exp), so SiLU may differ
// from PyTorch's in the last float32 bit, which changes a bfloat16 result only when it lies
// on a rounding boundary. Tails shorter than a vector and portable builds use the scalar loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "library.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace {

constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Round a float to T (round to nearest even for bfloat16 / half, as PyTorch does) and back.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

#ifdef PAGEDLLM_VEC
using namespace pagedllm_simd;
constexpr int64_t W = kVecWidth;
#endif

// One row: out[i] = w[i] * to_T(x[i] * inv_rms). Sum of squares in float32, one partial sum per lane
// (vectorisable) instead of PyTorch's reduction order: the only difference from HF.
template <typename T>
inline void rms_row(T* out, const T* x, const T* w, int64_t d, float eps) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef PAGEDLLM_VEC
  VecF acc = vset1(0.f);
  for (; i + W <= d; i += W) {
    const VecF v = vload(x + i);
    acc = vfmadd(v, v, acc);
  }
  sum = vreduce_add(acc);
#endif
  for (; i < d; ++i) {
    const float v = to_f(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  int64_t k = 0;
#ifdef PAGEDLLM_VEC
  const VecF vinv = vset1(inv);
  for (; k + W <= d; k += W) vstore(out + k, vload(w + k) * vround<T>(vload(x + k) * vinv));
#endif
  for (; k < d; ++k) {
    out[k] = static_cast<T>(to_f(w[k]) * round_to<T>(to_f(x[k]) * inv));
  }
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  // x, out: [T, H, D] with D contiguous (any outer strides).
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t * h, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t ti = r / h, hi = r % h;
      rms_row<T>(op + ti * os0 + hi * os1, xp + ti * xs0 + hi * xs1, wp, d, e);
    }
  });
}

template <typename T>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t t = x.size(0), d = x.size(1);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  T* xp = x.mutable_data_ptr<T>();
  T* rp = residual.mutable_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      int64_t k = 0;
#ifdef PAGEDLLM_VEC
      for (; k + W <= d; k += W) vstore(rr + k, vload(xr + k) + vload(rr + k));
#endif
      for (; k < d; ++k) rr[k] = static_cast<T>(to_f(xr[k]) + to_f(rr[k]));
      rms_row<T>(xr, rr, wp, d, e);
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t t = x.size(0), d = out.size(1);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, t, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + d;
      T* o = op + r * os;
      int64_t k = 0;
#ifdef PAGEDLLM_VEC
      const VecF one = vset1(1.0f), zero = vset1(0.f);
      for (; k + W <= d; k += W) {
        const VecF g = vload(gate + k);
        const VecF silu = g / (one + vexp(zero - g));
        vstore(o + k, vround<T>(silu) * vload(up + k));
      }
#endif
      for (; k < d; ++k) {
        const float g = to_f(gate[k]);
        o[k] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * to_f(up[k]));
      }
    }
  });
}

template <typename T>
inline void rotate_row(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
#ifdef PAGEDLLM_VEC
  const VecF zero = vset1(0.f);
  for (; i + W <= half; i += W) {
    const VecF x1 = vload(x + i), x2 = vload(x + i + half);
    const VecF a = vround<T>(x1 * vload(cos + i)) + vround<T>((zero - x2) * vload(sin + i));
    const VecF b = vround<T>(x2 * vload(cos + i + half)) + vround<T>(x1 * vload(sin + i + half));
    vstore(x + i, a);
    vstore(x + i + half, b);
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    const float a = round_to<T>(x1 * to_f(cos[i])) + round_to<T>(-x2 * to_f(sin[i]));
    const float b = round_to<T>(x2 * to_f(cos[i + half])) + round_to<T>(x1 * to_f(sin[i + half]));
    x[i] = static_cast<T>(a);
    x[i + half] = static_cast<T>(b);
  }
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), half = d / 2;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  T* qp = q.mutable_data_ptr<T>();
  T* kp = k.mutable_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  at::parallel_for(0, t, grain_rows((hq + hk) * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * cs;
      const T* s = sp + r * ss;
      for (int64_t h = 0; h < hq; ++h) rotate_row<T>(qp + r * qs0 + h * qs1, c, s, half);
      for (int64_t h = 0; h < hk; ++h) rotate_row<T>(kp + r * ks0 + h * ks1, c, s, half);
    }
  });
}

#define PAGEDLLM_DISPATCH(dtype, name, ...)                                          \
  switch (dtype) {                                                                   \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                 \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }      \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }              \
    default: TORCH_CHECK(false, name ": unsupported dtype ", dtype);                 \
  }

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes(), "rms_norm: x and out must be [T, H, D]");
  TORCH_CHECK(x.stride(2) == 1 && out.stride(2) == 1 && weight.is_contiguous(), "rms_norm: D must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(2), "rms_norm: weight must be [D]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x, out and weight must have one dtype");
  PAGEDLLM_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(out, x, weight, eps));
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "fused_add_rms_norm: x and residual must be [T, D]");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(),
              "fused_add_rms_norm: D must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "fused_add_rms_norm: weight must be [D]");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: x, residual and weight must have one dtype");
  PAGEDLLM_DISPATCH(x.scalar_type(), "fused_add_rms_norm", fused_add_rms_norm_impl<scalar_t>(x, residual, weight, eps));
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1),
              "silu_and_mul: x must be [T, 2d] and out [T, d]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "silu_and_mul: last dimension must be contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: x and out must have one dtype");
  PAGEDLLM_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(out, x));
}

void rotary_embedding(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "rotary_embedding: query [T, Hq, D] and key [T, Hk, D]");
  const int64_t d = query.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == query.size(0) && cos.size(1) == d,
              "rotary_embedding: cos and sin must be [T, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rotary_embedding: D must be contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rotary_embedding: query, key, cos and sin must have one dtype");
  PAGEDLLM_DISPATCH(dtype, "rotary_embedding", rotary_impl<scalar_t>(query, key, cos, sin));
}

#undef PAGEDLLM_DISPATCH

}  // namespace

PAGEDLLM_FRAGMENT(m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
}

PAGEDLLM_IMPL(CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
