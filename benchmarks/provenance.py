"""Which code a benchmark measured: HEAD and whether the tracked files match it, for the JSON it writes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


def git_state(stated_commit: Optional[str]) -> dict:
    """HEAD and whether the tracked files match it. A tree copied without its history (a device machine's
    copy) can state its commit with --commit; the clean check is then the caller's."""
    if stated_commit:
        return {"commit": stated_commit, "commit_source": "stated (--commit)", "clean": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "commit_source": "no git repository", "clean": None}
    return {"commit": head.stdout.strip(), "commit_source": "git rev-parse HEAD", "clean": not status.stdout.strip(),
            "dirty_files": status.stdout.split("\n")[:20] if status.stdout.strip() else []}
