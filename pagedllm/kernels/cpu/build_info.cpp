// The library of one ISA build of the CPU kernels (see library.h): its TORCH_LIBRARY block
// (each family of ops adds its own in a TORCH_LIBRARY_FRAGMENT) and build_info.

#include <torch/library.h>

#include "library.h"

#include <string>

namespace {

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

PAGEDLLM_LIBRARY(m) { m.def("build_info() -> str", &build_info); }
