"""Triton W4A16 kernels and their torch reference."""
