"""Test-session setup.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be chosen before
any kernel is defined; this is the tests' own setting, never the library's.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
