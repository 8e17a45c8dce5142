"""Fused ops, each a PyTorch reference plus an optional NKI implementation."""
