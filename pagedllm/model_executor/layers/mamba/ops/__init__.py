"""The ops of the state layers (vLLM's names and argument conventions), each in pure PyTorch,
the portable path on every device: ``causal_conv1d`` (the mixers' depthwise causal conv),
``ssd_combined`` (Mamba-2's chunked state-space scan over prefill chunks), ``mamba_ssm``
(its one-token recurrence in decode) and ``gated_delta`` (Qwen3-Next's gated delta rule).
The decode ops run the C++ CPU kernels where ``cpu_dispatch`` says so."""
