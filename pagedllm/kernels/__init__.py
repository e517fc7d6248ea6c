"""Native kernels beside the PyTorch code: ``cpu`` holds the C++ CPU kernels (paged decode
attention, RMSNorm, SwiGLU, rotary embedding), built on first use."""
