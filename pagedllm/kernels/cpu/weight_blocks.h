// The blocked weight layout shared by linear_w16.cpp (16-bit and int8 weights) and
// linear_grouped.cpp (4- and 8-bit weights in groups): N outputs cut into blocks of kBlock, each block one
// contiguous stream over the inputs. Up to kStreamRows rows of x go through the
// weight-streaming kernels (AVX2 and up: PAGEDLLM_BLOCK_STREAM); more rows through torch's
// float32 GEMM on chunks of kGemmChunkBytes of widened weights.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_BLOCK_STREAM 1
#endif

namespace pagedllm_blocks {

constexpr int64_t kBlock = 16;                 // outputs per block
constexpr int64_t kStreamRows = 16;            // x rows up to which the streaming kernels run
constexpr int64_t kGemmChunkBytes = 16 << 20;  // float32 weight buffer per GEMM chunk

}  // namespace pagedllm_blocks
