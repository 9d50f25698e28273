"""Test-session set-up shared by every module."""

import os

import torch

# Without CUDA the Triton kernels run under Triton's interpreter. Triton reads this when a kernel is defined,
# i.e. when a kernels module is first imported, so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
