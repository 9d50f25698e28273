"""Triton fp8/int8 and 1-bit kernels with their torch autograd wrappers."""
