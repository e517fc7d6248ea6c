"""Attention backends: the interface (``abstract``) and its implementations."""
