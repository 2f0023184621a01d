"""mhar_lit.tracking: the telemetry default, run names, and the tags `compare` groups by."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import python_path

from mhar_lit.residual import FullAttnRes, HyperConnections, StandardResidual
from mhar_lit.tracking import (
    is_standard_residual_run,
    local_store_path,
    method_tags,
    run_name_method,
    tag_run,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("given,expected", [(None, "true"), ("false", "false")])
def test_telemetry_is_off_unless_the_user_says_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    env.update({"PYTHONPATH": python_path(), **({"MLFLOW_DISABLE_TELEMETRY": given} if given else {})})
    code = "import os, mhar_lit.tracking; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected


def test_method_names_for_tables_and_run_names():
    assert method_tags(StandardResidual()) == {"method": "StandardResidual", "standard_residual": "true"}
    assert method_tags(FullAttnRes(heads=8)) == {"method": "FullAttnRes(heads=8)", "standard_residual": "false"}
    assert method_tags(HyperConnections(streams=4))["method"] == "HyperConnections(streams=4, dynamic=True, variant=zhu)"
    assert is_standard_residual_run(method_tags(StandardResidual()))
    assert not is_standard_residual_run(method_tags(FullAttnRes(heads=1)))
    assert is_standard_residual_run({"method": "StandardResidual"})  # a run logged before the tag existed
    assert run_name_method("mhar_lit.residual.FullAttnRes") == "FullAttnRes"
    assert run_name_method(None) == "StandardResidual"
    assert local_store_path("sqlite:///runs/mlflow.db") == "runs/mlflow.db"


def test_tag_run_sets_the_tags_compare_groups_by(tmp_path):
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/t.db"
    logger = MLFlowLogger(experiment_name="t", tracking_uri=uri)

    class Trainer:
        loggers = [logger]
        is_global_zero = True
        max_steps, precision, accumulate_grad_batches, num_devices = 100, "bf16-mixed", 4, 2
        strategy, gradient_clip_val, val_check_interval = object(), None, 50

    tag_run(Trainer(), FullAttnRes(heads=2), "tiny", "7")
    run = MlflowClient(uri).get_run(logger.run_id)
    tags = run.data.tags
    assert (tags["method"], tags["standard_residual"], tags["seed"], tags["size"]) == (
        "FullAttnRes(heads=2)", "false", "7", "tiny")
    assert {k: v for k, v in run.data.params.items() if k.startswith("trainer/")} == {
        "trainer/max_steps": "100", "trainer/precision": "bf16-mixed", "trainer/accumulate_grad_batches": "4",
        "trainer/devices": "2", "trainer/strategy": "object", "trainer/gradient_clip_val": "None",
        "trainer/val_check_interval": "50"}
