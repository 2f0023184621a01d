"""`compare` pools several MLflow stores (runs made side by side need one sqlite store each) and refuses an
ambiguous baseline."""

import json

import pytest

from mhar_lit.sweep import DEFAULT_EXPERIMENT, compare_main


def assert_refused(main, argv, message, capsys):
    """A refused input: exit code 2 and one line `error: ...` matching `message` on stderr."""
    import re

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and re.search(message, err), err


def _log_run(uri, method, seed, lr, tail):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(DEFAULT_EXPERIMENT)
    exp_id = exp.experiment_id if exp else client.create_experiment(DEFAULT_EXPERIMENT)
    run = client.create_run(exp_id, tags={"sweep_id": "pool", "method": method, "seed": str(seed),
                                          "mlflow.runName": f"{method}-s{seed}"})
    client.log_param(run.info.run_id, "lr", lr)
    client.log_metric(run.info.run_id, "val/tail_mean", tail)
    client.log_metric(run.info.run_id, "val/loss", tail - 0.1)
    client.set_terminated(run.info.run_id)


def test_compare_pairs_across_stores_and_refuses_two_baselines(tmp_path, capsys):
    a, b = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    _log_run(a, "StandardResidual", 1, "0.001", 1.50)
    _log_run(b, "FullAttnRes(heads=8)", 1, "0.001", 1.45)  # its baseline lives in the other store
    _log_run(b, "FullAttnRes(heads=1)", 2, "0.001", 1.40)  # no baseline at seed 2 anywhere
    out = tmp_path / "pool.json"
    assert compare_main(["--sweep", "pool", "--tracking-uri", a, "--tracking-uri", b, "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["FullAttnRes(heads=8)"]["delta"] == pytest.approx(-0.05)
    assert rows["FullAttnRes(heads=1)"]["delta"] != rows["FullAttnRes(heads=1)"]["delta"]  # NaN: unpaired

    _log_run(b, "StandardResidual", 1, "0.001", 1.52)  # a second baseline at the same seed and lr
    assert_refused(compare_main, ["--sweep", "pool", "--tracking-uri", a, "--tracking-uri", b],
                   "two baseline runs at seed 1 and lr 0.001", capsys)
    assert_refused(compare_main, ["--sweep", "nope", "--tracking-uri", a], "no runs tagged sweep_id='nope'", capsys)


def test_compare_does_not_create_a_store_at_a_mistyped_uri(tmp_path, capsys):
    """MLflow would create typo/dir/ and an empty database there, then report "no runs"."""
    missing = tmp_path / "typo" / "dir" / "mlflw.db"
    assert_refused(compare_main, ["--sweep", "x", "--tracking-uri", f"sqlite:///{missing}"],
                   f"no MLflow store at {missing}", capsys)
    assert_refused(compare_main, ["--sweep", "x", "--tracking-uri", str(tmp_path / "no-mlruns")],
                   "no MLflow store at", capsys)
    assert not (tmp_path / "typo").exists() and not (tmp_path / "no-mlruns").exists()


@pytest.mark.parametrize("uri,path", [
    ("sqlite:///mlflow.db", "mlflow.db"),
    ("sqlite:////tmp/a%20b.db?timeout=5", "/tmp/a b.db"),  # MLflow's SQLAlchemy decodes the path
    ("file:///tmp/a%20b/mlruns", "/tmp/a b/mlruns"),
    ("file://localhost/tmp/mlruns", "/tmp/mlruns"),
    ("./mlruns", "./mlruns"),
    ("http://host:5000", None),
    ("databricks", None),
    ("databricks-uc", None),
    ("postgresql://user@host/db", None),
])
def test_local_store_path_of_each_uri_form(uri, path):
    from mhar_lit.tracking import local_store_path

    assert local_store_path(uri) == path


# ----------------------------------------------------------------------------- killed, resumed, duplicated runs
def _run(client, exp_id, method, seed, history, tail=None, status="FINISHED", tags=None, lr="0.001", start=None):
    run = client.create_run(exp_id, start_time=start, tags={"sweep_id": "kr", "method": method, "seed": str(seed),
                                                             "mlflow.runName": f"{method}-s{seed}", **(tags or {})})
    client.log_param(run.info.run_id, "lr", lr)
    for step, value in history:
        client.log_metric(run.info.run_id, "val/loss", value, step=step)
    if tail is not None:
        client.log_metric(run.info.run_id, "val/tail_mean", tail)
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def _exited_pid():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_compare_chains_resumed_runs_and_pairs_only_finished_ones(tmp_path, capsys):
    """A sweep's MHAR run killed at step 49 and resumed (a new run tagged resumed_from_run) to the end, next to a
    finished baseline: one MHAR row (one seed), whose history is the concatenation and whose delta is against
    the baseline; a second MHAR seed still running (its process alive) is shown with its state and step, and
    left out of the means. The killed run, RUNNING in the store (kill -9 never finalizes), is marked KILLED."""
    import socket

    from mlflow.tracking import MlflowClient

    from mhar_lit.tracking import process_tags

    uri = f"sqlite:///{tmp_path}/kr.db"
    client = MlflowClient(uri)
    exp = client.create_experiment(DEFAULT_EXPERIMENT)
    _run(client, exp, "StandardResidual", 1, [(49, 2.0), (99, 1.8)], tail=1.9)
    dead = {"host": socket.gethostname(), "pid": str(_exited_pid()), "pid_start": ""}
    killed = _run(client, exp, "FullAttnRes(heads=8)", 1, [(49, 1.95), (74, 1.9)], tail=1.95, status="RUNNING",
                  tags=dead)
    _run(client, exp, "FullAttnRes(heads=8)", 1, [(74, 1.85), (99, 1.7)], tail=1.75,
         tags={"resumed_from_run": killed})  # resumed from the step-50 checkpoint: its step 74 replaces the parent's
    _run(client, exp, "FullAttnRes(heads=8)", 2, [(49, 1.97)], tail=1.97, status="RUNNING", tags=process_tags())
    out = tmp_path / "kr.json"
    assert compare_main(["--sweep", "kr", "--tracking_uri", uri, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    mhar = sorted((r for r in rows if r["method"] == "FullAttnRes(heads=8)"), key=lambda r: r["seed"])
    assert len(mhar) == 2 and len(mhar[0]["runs"]) == 2
    assert mhar[0]["status"] == "FINISHED" and mhar[0]["final"] == pytest.approx(1.7)
    assert mhar[0]["delta"] == pytest.approx(1.75 - 1.9)
    assert mhar[1]["status"] == "RUNNING" and mhar[1]["step"] == 49 and mhar[1]["delta"] != mhar[1]["delta"]
    assert client.get_run(killed).info.status == "KILLED"
    summary = json.loads(out.read_text())["summary"]
    by_method = {s["method"]: s for s in summary}
    assert by_method["FullAttnRes(heads=8)"]["runs"] == 1 and by_method["FullAttnRes(heads=8)"]["paired"] == 1
    assert by_method["FullAttnRes(heads=8)"]["unfinished"] == 1
    assert "RUNNING@49" in printed and "1 unfinished run(s) are shown but left out" in printed

    # the same MHAR seed started again from scratch and finished: two seeds' worth of one seed, refused
    _run(client, exp, "FullAttnRes(heads=8)", 1, [(99, 1.72)], tail=1.74)
    assert_refused(compare_main, ["--sweep", "kr", "--tracking_uri", uri],
                   r"two finished runs of FullAttnRes\(heads=8\) at seed 1 with the same", capsys)


def test_a_killed_run_without_a_successor_is_not_paired(tmp_path, capsys):
    """kill -9 of the MHAR child mid-sweep: its early validation used to be paired against the finished
    baseline, unmarked."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/k.db"
    client = MlflowClient(uri)
    exp = client.create_experiment(DEFAULT_EXPERIMENT)
    _run(client, exp, "StandardResidual", 1, [(49, 2.0), (99, 1.8)], tail=1.9)
    _run(client, exp, "FullAttnRes(heads=8)", 1, [(49, 1.95)], tail=1.95, status="KILLED")
    out = tmp_path / "k.json"
    assert compare_main(["--sweep", "kr", "--tracking_uri", uri, "--json", str(out)]) == 0
    mhar = next(r for r in json.loads(out.read_text())["rows"] if r["method"] != "StandardResidual")
    assert mhar["delta"] != mhar["delta"] and mhar["status"] == "KILLED"
    assert "KILLED@49" in capsys.readouterr().out


def test_sweep_resume_plan_skips_finished_points_and_continues_killed_ones(tmp_path):
    from mlflow.tracking import MlflowClient

    from mhar_lit.sweep import point_tag, resume_plan

    uri = f"sqlite:///{tmp_path}/rs.db"
    assert resume_plan(uri, DEFAULT_EXPERIMENT, "kr", {"seed_everything": "1"})[0] == "start"  # no store yet
    client = MlflowClient(uri)
    exp = client.create_experiment(DEFAULT_EXPERIMENT)
    points = {name: {"config": f"{name}.yaml", "seed_everything": "1"} for name in ("done", "killed", "early")}
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / "last.ckpt").write_bytes(b"x")
    tag = lambda name, **more: {"sweep_point": point_tag(points[name]), **more}  # noqa: E731
    _run(client, exp, "A", 1, [(2, 1.0)], tags=tag("done"))
    _run(client, exp, "B", 1, [(2, 1.0)], status="KILLED", tags=tag("killed", checkpoint_dir=str(folder)))
    _run(client, exp, "C", 1, [], status="KILLED", tags=tag("early", checkpoint_dir=str(tmp_path / "none")))
    plans = {name: resume_plan(uri, DEFAULT_EXPERIMENT, "kr", point) for name, point in points.items()}
    assert plans == {"done": ("skip", "finished"), "killed": ("resume", str(folder / "last.ckpt")),
                     "early": ("start", "no checkpoint to resume from")}
