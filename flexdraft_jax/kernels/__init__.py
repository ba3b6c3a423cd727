"""Pallas kernels (TPU Mosaic / GPU Triton, interpretable on CPU)."""

from flexdraft_jax.kernels.attention import attend_pallas

__all__ = ["attend_pallas"]
