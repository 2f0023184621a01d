"""PYTHONPATH for a test's child process: the repository (or the given folders) first, and whatever PYTHONPATH
already holds kept behind it: on the GPU machine the packages it lacks are installed with `pip --target` and
found only through PYTHONPATH."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_path(*first) -> str:
    return os.pathsep.join(p for p in (*map(str, first or (REPO,)), os.environ.get("PYTHONPATH", "")) if p)
