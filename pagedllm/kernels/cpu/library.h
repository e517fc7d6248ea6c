// Operator registration for one ISA build of the CPU kernels.
//
// __init__.py builds these sources once per instruction-set level (see pagedllm/kernels/isa.py)
// and passes -DPAGEDLLM_OPS=pagedllm_cpu_<level>, so each build registers its operators in a
// namespace of its own (torch.ops.pagedllm_cpu_avx2.rms_norm, ...): several builds can be
// loaded in one process, and tests run each path the host supports side by side.
#pragma once

#include <torch/library.h>

#include <string>

#ifndef PAGEDLLM_OPS
#define PAGEDLLM_OPS pagedllm_cpu
#endif

// One level of indirection so that PAGEDLLM_OPS is expanded before torch pastes it.
#define PAGEDLLM_LIBRARY_EXPAND(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDLLM_FRAGMENT_EXPAND(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define PAGEDLLM_IMPL_EXPAND(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define PAGEDLLM_LIBRARY(m) PAGEDLLM_LIBRARY_EXPAND(PAGEDLLM_OPS, m)
#define PAGEDLLM_FRAGMENT(m) PAGEDLLM_FRAGMENT_EXPAND(PAGEDLLM_OPS, m)
#define PAGEDLLM_IMPL(key, m) PAGEDLLM_IMPL_EXPAND(PAGEDLLM_OPS, key, m)

// PAGEDLLM_INLINE_LAMBDA (after a lambda's parameters) inlines it as PAGEDLLM_INLINE does a
// function. PAGEDLLM_HIDDEN marks a namespace whose symbols several source files of a build share:
// every ISA build can be loaded in one process (torch loads them with RTLD_GLOBAL), and each
// must call its own code.
#if defined(__GNUC__)
#define PAGEDLLM_INLINE inline __attribute__((always_inline))
#define PAGEDLLM_NOINLINE __attribute__((noinline))
#define PAGEDLLM_HIDDEN __attribute__((visibility("hidden")))
#define PAGEDLLM_INLINE_LAMBDA __attribute__((always_inline))
#else
#define PAGEDLLM_INLINE inline
#define PAGEDLLM_NOINLINE
#define PAGEDLLM_HIDDEN
#define PAGEDLLM_INLINE_LAMBDA
#endif
