"""Checks on local output paths, shared by the commands that write files (fit, probe, convert)."""

from __future__ import annotations

import os
import tempfile
from typing import Optional


def nearest_existing(path: str | os.PathLike) -> str:
    """`path` itself if it exists, else its nearest existing ancestor (where os.makedirs would start)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def cannot_create_files_in(folder: str | os.PathLike) -> Optional[str]:
    """Why no file can be created in the existing directory `folder` (the OS error's text), else None.

    A real write, not os.access: also right for read-only mounts and for root (who passes every chmod)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None
