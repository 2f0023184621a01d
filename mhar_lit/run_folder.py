"""Where a run's checkpoints go, and which checkpoint `--ckpt_path last` means.

An unnamed `fit` writes to a new folder `<default_root_dir>/<experiment id>/<folder id>/checkpoints` (its
MLflow run's `checkpoint_dir` tag says which). A named one, `fit --run_name NAME`, writes to the stable folder
`<default_root_dir>/NAME/checkpoints` and its MLflow run is called NAME, so that

    python -m mhar_lit fit --config C --run_name NAME --ckpt_path last

resumes it from the newest checkpoint of that folder whose sha256 sidecar verifies. `--ckpt_path last` without
a name, or with a name whose folder holds no verified checkpoint, is an error (Lightning would start from
scratch with a warning); a fresh fit under a name whose folder already holds checkpoints is refused too (two
runs would mix their files in one folder).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

from mhar_lit.errors import UserError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")


def named_run_folder(root: str, run_name: str) -> Path:
    """`<root>/<run_name>/checkpoints`; the name is one path component of letters, digits, '.', '_', '-'."""
    if not _NAME.match(run_name):
        raise UserError(f"--run_name {run_name!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
    return Path(root) / run_name / "checkpoints"


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint files of a folder, last.ckpt first, then the others newest first."""
    files = [p for p in folder.glob("*.ckpt") if p.is_file()] if folder.is_dir() else []
    return sorted(files, key=lambda p: (p.name != "last.ckpt", -p.stat().st_mtime))


def newest_verified_checkpoint(folder: Path) -> Optional[Path]:
    """The first of `checkpoint_files` whose sidecar verifies (a damaged or unrecorded one is skipped, said)."""
    from mhar_lit.checkpoint import verify_checkpoint

    for path in checkpoint_files(folder):
        try:
            verify_checkpoint(path)
            return path
        except UserError as err:
            log.warning("--ckpt_path last: skipping %s: %s", path, err)
    return None


def apply_run_name(config: Any) -> None:
    """For `--run_name`: the stable checkpoint folder, the MLflow run's name, and `--ckpt_path last` resolved
    to a file (module docstring). `config` is one subcommand's parsed namespace."""
    run_name, ckpt = config.get("run_name"), config.get("ckpt_path")
    if not run_name:
        if ckpt == "last":
            raise UserError("--ckpt_path last needs --run_name NAME: an unnamed fit writes to a new folder each "
                            "time, where no last.ckpt can be; pass the run's name, or the checkpoint's path")
        return
    root = (config.get("trainer") or {}).get("default_root_dir") or "runs"
    folder = named_run_folder(str(root), run_name)
    if config.get("checkpoint.dirpath"):
        folder = Path(config["checkpoint.dirpath"])
    else:
        config["checkpoint.dirpath"] = str(folder)
    _name_logger(config, run_name)
    if ckpt == "last":
        found = newest_verified_checkpoint(folder)
        if found is None:
            raise UserError(f"--ckpt_path last: no verified checkpoint of run {run_name!r} in {folder} (a fit with "
                            f"--run_name {run_name} saves there); start it without --ckpt_path")
        config["ckpt_path"] = str(found)
        import warnings  # the folder holds the run's own checkpoints: Lightning's caution about it is noise here

        warnings.filterwarnings("ignore", message=rf"Checkpoint directory .*{re.escape(str(folder))} exists")
        log.info("--ckpt_path last: resuming run %s from %s", run_name, found)
    elif not ckpt and checkpoint_files(folder):
        raise UserError(f"--run_name {run_name}: {folder} already holds checkpoints of a run of that name: resume "
                        "it with --ckpt_path last, or choose another --run_name")


def _name_logger(config: Any, run_name: str) -> None:
    logger = (config.get("trainer") or {}).get("logger")
    init_args = logger.get("init_args") if hasattr(logger, "get") else None
    if init_args is not None and "run_name" in init_args and not init_args.get("run_name"):
        init_args["run_name"] = run_name


def remove_stale_temp_files_near(folder: str | os.PathLike) -> list[Path]:
    """Temp files of killed checkpoint saves in this run's folder and in its sibling run folders
    (`<parent>/*/checkpoints`): a run restarted instead of resumed writes to a new folder, and would never
    visit the old one. Only files whose writer's lock is free are removed (a live save keeps its file)."""
    from mhar_lit.lit.checkpoint_io import remove_stale_temp_files

    folder = Path(folder)
    runs = folder.parent.parent if folder.name == "checkpoints" else folder.parent
    folders = {folder, *(p for p in runs.glob("*/checkpoints") if p.is_dir())} if runs.is_dir() else {folder}
    return [removed for f in sorted(folders) for removed in remove_stale_temp_files(f)]
