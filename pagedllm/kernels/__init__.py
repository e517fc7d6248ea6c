"""Native kernels beside the PyTorch code: ``cpu`` holds the C++ CPU kernels (paged decode
attention, RMSNorm, SwiGLU, rotary embedding, greedy argmax, few-row and 16-bit-weight
matmuls), built on first use for the instruction-set level ``isa`` picks."""
