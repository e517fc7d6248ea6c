"""State-space and linear-attention layers (Mamba-2, Gated DeltaNet) and their ops."""
