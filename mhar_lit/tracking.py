"""MLflow conventions of the package in one place: the default store and experiment, local store paths,
the tags a training run gets (what `compare` groups by) and how a run's method is named in tables.

Importing this module sets the telemetry default (MLflow 3 sends usage telemetry to a remote endpoint
unless told not to; training must not touch the network). MLflow itself is imported only where used.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

from mhar_lit.errors import UserError, redact_credentials  # noqa: F401 (redact_credentials: its public home)

# An embedded sqlite store in the working directory unless MLFLOW_TRACKING_URI points at a server.
DEFAULT_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
DEFAULT_EXPERIMENT = "mhar_lit"


def disable_telemetry_by_default() -> None:
    """MLFLOW_DISABLE_TELEMETRY=true unless the user set it (MLFLOW_DISABLE_TELEMETRY=false opts back in). Also
    MLflow's "View run ... at: URL" line, which prints a server URI with its password: the fit summary prints
    the run's address with the password redacted instead."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


disable_telemetry_by_default()


def local_store_path(tracking_uri: str) -> Optional[str]:
    """The file or folder of a local MLflow store URI (sqlite:///PATH, file:PATH or a plain path), else None.
    Commands that only read a store check it exists: MLflow creates an empty one (and its folders) on access."""
    from urllib.parse import unquote, urlparse

    if tracking_uri.startswith("sqlite:///"):  # sqlite:///rel.db, sqlite:////abs.db (percent-encoded, ?query)
        return unquote(tracking_uri[len("sqlite:///"):].split("?")[0])
    if tracking_uri.startswith("file:"):  # file:rel, file:///abs, file://localhost/abs
        return unquote(urlparse(tracking_uri).path)
    if "://" in tracking_uri or tracking_uri.startswith("databricks"):  # servers, databricks[-uc][://profile]
        return None
    return tracking_uri


def method_tags(residual: Any) -> dict[str, str]:
    """What a run's strategy says about itself, as the tags `compare` reads: `method` (its `method_label()`, the
    grouping key) and `standard_residual` ("true" for the baseline every run is paired against)."""
    return {"method": residual.method_label(), "standard_residual": str(residual.is_standard_residual).lower()}


def is_standard_residual_run(tags: dict[str, str]) -> bool:
    """Whether a run's tags mark the standard residual; runs logged before the `standard_residual` tag
    existed carry only the label, whose form for the standard residual has not changed."""
    if "standard_residual" in tags:
        return tags["standard_residual"] == "true"
    return tags.get("method") == "StandardResidual"


def run_name_method(class_path: Optional[str]) -> str:
    """The method part of a run name, from the strategy's class path in a config (before it is built):
    the class name, as ResidualStrategy.method_label() starts with."""
    return str(class_path or "").rsplit(".", 1)[-1] or "StandardResidual"


def trainer_params(trainer: Any) -> dict[str, Any]:
    """The trainer settings that decide what a run computed, as `trainer/...` params."""
    strategy = trainer.strategy
    return {
        "trainer/max_steps": trainer.max_steps,
        "trainer/precision": trainer.precision,
        "trainer/accumulate_grad_batches": trainer.accumulate_grad_batches,
        "trainer/devices": trainer.num_devices,
        "trainer/strategy": type(strategy).__name__,
        "trainer/gradient_clip_val": trainer.gradient_clip_val,
        "trainer/val_check_interval": trainer.val_check_interval,
    }


def tag_run(trainer: Any, residual: Any, size: str, seed: Optional[str]) -> None:
    """Sets the method / standard_residual / seed / size tags that `compare` groups by and logs the trainer settings as params
    (MLflow loggers only). Through the package's logger they wait for the run to open (its first write)."""
    from lightning.pytorch.loggers import MLFlowLogger

    tags = {**method_tags(residual), "seed": seed or "?", "size": size}
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger) and trainer.is_global_zero:
            if hasattr(logger, "set_tags"):
                logger.set_tags(tags)
            else:
                for key, value in tags.items():
                    logger.experiment.set_tag(logger.run_id, key, value)
            logger.log_hyperparams(trainer_params(trainer))

# ----------------------------------------------------------------------------- credentials


# ----------------------------------------------------------------------------- one safe first open of a store
EXPECTED_TABLES = ("experiments", "runs", "metrics", "params", "tags", "alembic_version")


def _latest_schema_revision() -> Optional[str]:
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision  # private: MLflow has no public name
    except ImportError:
        return None
    return _get_latest_schema_revision()


def check_store_schema(path: str, tracking_uri: str) -> None:
    """Refuse an sqlite store left half-migrated (a creation interrupted, or two processes creating it at once):
    some of MLflow's tables without the alembic version table, or a version other than this MLflow's head.
    A missing or empty file is fine: MLflow creates it."""
    import sqlite3

    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        with contextlib.closing(sqlite3.connect(path)) as db:  # (read-only mode fails on a store left with a WAL)
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                return
            version = None
            if "alembic_version" in tables:
                version = next(iter(db.execute("SELECT version_num FROM alembic_version")), (None,))[0]
            pages = db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]
        if pages > os.path.getsize(path):  # sqlite finds a cut file only when it reads a missing page, mid-run
            raise sqlite3.DatabaseError(f"database disk image is malformed: {os.path.getsize(path)} bytes of "
                                        f"{pages}")
    except sqlite3.DatabaseError as err:  # truncated or overwritten: "database disk image is malformed"
        raise UserError(
            f"the MLflow store {path} cannot be read ({err}): the file is damaged (truncated, or not an sqlite "
            f"database). Move it away to start a new store, or try to recover its runs with "
            f"`sqlite3 {path} .recover | sqlite3 recovered.db` and use recovered.db") from None
    missing = [t for t in EXPECTED_TABLES if t not in tables]
    head = _latest_schema_revision()
    if missing or (head is not None and version != head):
        found = f"tables missing: {', '.join(missing)}" if missing else f"schema version {version}, expected {head}"
        raise UserError(
            f"the MLflow store {path} is not a complete MLflow {_mlflow_version()} database ({found}); it was "
            f"probably left half-migrated by an interrupted or concurrent creation. Repair it with "
            f"`mlflow db upgrade {tracking_uri}` (mlflow=={_mlflow_version()}), after a backup, or move the file "
            "away to start a new store")


def _mlflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("mlflow", "mlflow-skinny"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


@contextlib.contextmanager
def store_lock(path: str):
    """An exclusive `fcntl.flock` on `<store>.lock` beside the store, held for the block."""
    import fcntl

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_store(tracking_uri: str) -> None:
    """Open an sqlite store once, under a file lock, before a logger touches it: MLflow creates the tables and
    runs its schema migrations on first open, and two processes doing that at once fail (`table already
    exists`) and can leave the file half-migrated. The process keeps the opened store (MLflow caches it per
    URI). Other stores (servers, file stores) have no migration to race on: untouched."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    from mlflow.tracking import MlflowClient

    path = local_store_path(tracking_uri)
    with store_lock(path):
        check_store_schema(path, tracking_uri)
        MlflowClient(tracking_uri).search_experiments(max_results=1)


# ----------------------------------------------------------------------------- runs whose process is gone
# A RUNNING run is dead when its host is this host and its process is not alive (or the pid now belongs to a
# process started at another time), or, wherever it ran, when it has logged nothing for STALE_AFTER_S
# (MHAR_STALE_RUN_HOURS, default 24: longer than any validation or checkpoint pause of the configs here).
STALE_AFTER_S = float(os.environ.get("MHAR_STALE_RUN_HOURS", "24")) * 3600


def _process_start(pid: int) -> Optional[str]:
    """`<boot id>:<start time in clock ticks>` of a process (Linux /proc), None where unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = fh.read().rsplit(")", 1)[1].split()[19]  # field 22; the name in () may hold spaces
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return f"{fh.read().strip()}:{ticks}"
    except (OSError, IndexError):
        return None


def process_tags() -> dict[str, str]:
    """The tags that let a later process tell whether this one is still alive: host, pid, pid start."""
    import socket

    return {"host": socket.gethostname(), "pid": str(os.getpid()), "pid_start": _process_start(os.getpid()) or ""}


def _pid_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    now = _process_start(pid)
    return not (start and now and now != start)  # a reused pid belongs to a process started later


def _last_activity_s(client: Any, run: Any) -> float:
    latest = run.info.start_time or 0
    for key in ("train/loss", "val/loss"):
        if key in run.data.metrics:
            latest = max([latest] + [m.timestamp for m in client.get_metric_history(run.info.run_id, key)[-1:]])
    return latest / 1000.0


def run_is_dead(client: Any, run: Any, now: Optional[float] = None) -> bool:
    import socket
    import time

    tags = run.data.tags
    if tags.get("host") == socket.gethostname() and tags.get("pid", "").isdigit():
        return not _pid_alive(int(tags["pid"]), tags.get("pid_start", ""))
    return (now or time.time()) - _last_activity_s(client, run) > STALE_AFTER_S


def reap_dead_runs(client: Any, experiment_ids: list[str]) -> list[str]:
    """Mark KILLED the RUNNING runs whose process is gone (rule above); returns their ids. A killed process
    (kill -9, OOM, a lost node) never finalizes its run: MLflow would show it RUNNING forever."""
    runs = client.search_runs(experiment_ids, filter_string="attributes.status = 'RUNNING'", max_results=5000)
    dead = [run for run in runs if run_is_dead(client, run)]
    for run in dead:
        client.set_terminated(run.info.run_id, "KILLED")
        client.set_tag(run.info.run_id, "killed_reason", "process gone (marked by mhar_lit)")
    return [run.info.run_id for run in dead]
