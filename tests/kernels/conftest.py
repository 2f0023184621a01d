"""Kernel tests run the Triton kernels on CPU through the interpreter; the variable must be set before
triton decorates any kernel, i.e. before mhar_lit.kernels is first imported."""

import os

os.environ["TRITON_INTERPRET"] = "1"
