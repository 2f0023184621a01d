"""Test-suite set-up shared by every test module.

Triton kernels run on CPU tensors through Triton's interpreter in the tests. Triton reads
TRITON_INTERPRET when @triton.jit decorates a function, so it must be set before any test module
imports mhar_lit.kernels (pytest may collect top-level test files before tests/kernels/).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
