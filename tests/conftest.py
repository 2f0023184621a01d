"""Test-suite set-up shared by every test module.

Triton kernels run on CPU tensors through Triton's interpreter in the tests. Triton reads
TRITON_INTERPRET when @triton.jit decorates a function, so it must be set before any test module
imports mhar_lit.kernels (pytest may collect top-level test files before tests/kernels/).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0 keeps compiled kernels (the GPU matrix test)


import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from seeds import draw_seed  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded_global_rngs():
    """Every test starts from global RNGs seeded by its own fixed seed (tests/seeds.py), so a test's draws do not
    depend on which tests ran before it; MHAR_RANDOM_SEEDS=1 draws fresh seeds instead."""
    seed = draw_seed()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    yield
