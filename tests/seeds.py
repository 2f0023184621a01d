"""Seeds of the tests' random draws: fixed per test in CI, fresh with MHAR_RANDOM_SEEDS=1.

A fixed seed per test (a hash of its pytest node id) makes a failure reproducible and CI deterministic; fresh seeds
are opt-in for hunting rare failures, and every test that draws prints its seed in its failure message.
"""

import os
import secrets
import zlib


def draw_seed() -> int:
    """The seed of the calling test (stable across runs) or, with MHAR_RANDOM_SEEDS=1, a fresh one."""
    if os.environ.get("MHAR_RANDOM_SEEDS") == "1":
        return secrets.randbelow(2**31)
    node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    return zlib.crc32(node.encode()) % 2**31
