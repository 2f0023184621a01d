"""MLflow conventions of the package in one place: the default store and experiment, local store paths,
the tags a training run gets (what `compare` groups by) and how a run's method is named in tables.

Importing this module sets the telemetry default (MLflow 3 sends usage telemetry to a remote endpoint
unless told not to; training must not touch the network). MLflow itself is imported only where used.
"""

from __future__ import annotations

import os
from typing import Any, Optional

# An embedded sqlite store in the working directory unless MLFLOW_TRACKING_URI points at a server.
DEFAULT_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
DEFAULT_EXPERIMENT = "mhar_lit"


def disable_telemetry_by_default() -> None:
    """MLFLOW_DISABLE_TELEMETRY=true unless the user set it (MLFLOW_DISABLE_TELEMETRY=false opts back in)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


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


def method_label(residual: Any) -> str:
    """How a run's method is named in tags and `compare` tables: the strategy's own `method_label()`."""
    return residual.method_label()


def run_name_method(class_path: Optional[str]) -> str:
    """The method part of a run name, from the strategy's class path in a config (before it is built):
    the class name, as ResidualStrategy.method_label() starts with."""
    return str(class_path or "").rsplit(".", 1)[-1] or "StandardResidual"


def tag_run(trainer: Any, residual: Any, size: str, seed: Optional[str]) -> None:
    """Sets the method / seed / size tags that `compare` groups by (MLflow loggers only)."""
    from lightning.pytorch.loggers import MLFlowLogger

    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger) and trainer.is_global_zero:
            for key, value in {"method": method_label(residual), "seed": seed or "?", "size": size}.items():
                logger.experiment.set_tag(logger.run_id, key, value)
