"""Multi-process training on CPU: DDP equals single-process training; FSDP sharding gives the same gradients."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import python_path

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": python_path(), "TRITON_INTERPRET": "1"}


def _run(args, cwd):
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


DDP_RESIDUALS = ["mhar", "delta"]


@pytest.fixture(scope="session")
def ddp_and_single_runs(built_once) -> Path:
    """tests/distributed_run.py over DDP_RESIDUALS, single-process and 2-rank DDP, once per test run. The
    single-process reference fits in this process (a process of its own would add ~12 s of Lightning's
    import and check nothing more); the DDP ranks are processes, as they must be."""
    from distributed_run import fit

    with built_once("ddp_and_single_runs") as (folder, done):
        if not done:
            for residual in DDP_RESIDUALS:
                fit(str(folder / "single" / residual), "auto", 1, residual)
            _run([str(TESTS / "distributed_run.py"), str(folder / "ddp"), "ddp", "2", *DDP_RESIDUALS], folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("residual", DDP_RESIDUALS)
def test_ddp_two_processes_reproduce_single_process_losses(ddp_and_single_runs, residual):
    """2-rank DDP (gloo) over the same global batches: the mean of the ranks' losses equals the single-process
    loss at every step (float32, 4 steps: gradient all-reduce, clipping, AdamW and schedule all agree)."""
    single = json.loads((ddp_and_single_runs / "single" / residual / "losses_rank0.json").read_text())
    ranks = [json.loads((ddp_and_single_runs / "ddp" / residual / f"losses_rank{r}.json").read_text())
             for r in (0, 1)]
    assert [row["step"] for row in single] == [1, 2, 3, 4]
    for step, row in enumerate(single):
        assert ranks[0][step]["rows"] == ranks[1][step]["rows"] == row["rows"] // 2
        mean = (ranks[0][step]["loss"] + ranks[1][step]["loss"]) / 2
        # fp32 sums in another order (all-reduce vs one batch): agreement to ~1e-6 relative.
        assert mean == pytest.approx(row["loss"], rel=2e-6), (step, mean, row["loss"])
    assert single[-1]["loss"] != single[0]["loss"]  # the steps really trained


FSDP_STRATEGIES = ["standard", "hc", "mhar", "block", "delta", "mhar-triton", "delta-triton"]


@pytest.fixture(scope="session")
def fsdp_reports(built_once) -> dict:
    """tests/fsdp_cpu_run.py over every strategy in one pair of processes, once per test run."""
    with built_once("fsdp_reports") as (folder, done):
        out = folder / "reports.json"
        if not done:
            _run([str(TESTS / "fsdp_cpu_run.py"), str(out), *FSDP_STRATEGIES], folder)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_fsdp_sharding_gives_unsharded_gradients(fsdp_reports, strategy):
    """FSDP2 full sharding (every layer and the root, parameters resharded after forward) over 2 CPU ranks:
    gathered gradients equal a single-process backward over the whole batch to fp32 rounding."""
    report = fsdp_reports[strategy]
    assert report["sharded"] is True
    assert report["max_rel_grad_err"] < 1e-5, report
