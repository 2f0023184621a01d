"""The package's MLflow logger and store handling in real processes: a fresh sqlite store opened by several
processes at once, DDP with one run, no run for a process that never trained, params on a resumed run,
credentials kept out of printed and uploaded configs, and runs whose process died."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_env import python_path
from test_cli import REPO, _fit, _tiny_args

ENV = {**os.environ, "PYTHONPATH": python_path(), "TRITON_INTERPRET": "1"}

# One process of the race: for each store URI, say "ready", wait for the test's "go" (so that both processes open
# the fresh store at the same moment, after their imports), then open the store, log a metric and finish a run.
OPEN_AND_LOG = """
import sys
from mhar_lit.lit.mlflow_logger import MLflowRunLogger
for uri in sys.argv[2:]:
    print("ready", flush=True)
    assert sys.stdin.readline() == "go\\n"
    logger = MLflowRunLogger(experiment_name="race", tracking_uri=uri, run_name=sys.argv[1])
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
"""
RACE_ROUNDS = 3


def _release_together(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait until every process said "ready" (other lines it prints are passed over), then tell them all "go"."""
    for proc, log in zip(procs, logs):
        line = None
        while line not in ("ready\n", ""):
            line = proc.stdout.readline()
        assert line, f"exit {proc.wait()} before it was ready:\n{log.read_text()[-2000:]}"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()


@pytest.mark.slow
def test_two_processes_opening_a_fresh_sqlite_store_at_once_both_succeed(tmp_path):
    """Without the lock both ran MLflow's table creation and migrations on the empty file: `table already
    exists`, and a store that could be left half-migrated. Two processes open RACE_ROUNDS fresh stores, released
    together on each one."""
    from mlflow.tracking import MlflowClient

    uris = [f"sqlite:///{tmp_path}/x{i}.db" for i in range(RACE_ROUNDS)]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", OPEN_AND_LOG, f"p{i}", *uris], env=ENV, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err))
    try:
        for _ in uris:
            _release_together(procs, logs)
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log.read_text()[-2000:] for log in logs)
    for uri in uris:
        exp = MlflowClient(uri).get_experiment_by_name("race")
        runs = MlflowClient(uri).search_runs([exp.experiment_id])
        assert sorted(r.info.run_name for r in runs) == ["p0", "p1"] and {r.info.status for r in runs} == {"FINISHED"}


def test_a_half_migrated_store_is_named_with_its_repair(tmp_path):
    import sqlite3

    from mhar_lit.errors import UserError
    from mhar_lit.tracking import prepare_store

    path = tmp_path / "half.db"
    with sqlite3.connect(path) as db:  # tables created, the migrations never recorded
        db.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY)")
        db.execute("CREATE TABLE runs (run_uuid TEXT PRIMARY KEY)")
    uri = f"sqlite:///{path}"
    with pytest.raises(UserError, match=rf"tables missing: .*alembic_version.*mlflow db upgrade {uri}.*move the file"):
        prepare_store(uri)
    with sqlite3.connect(path) as db:
        for table in ("metrics", "params", "tags"):
            db.execute(f"CREATE TABLE {table} (x INTEGER)")
        db.execute("CREATE TABLE alembic_version (version_num TEXT)")
        db.execute("INSERT INTO alembic_version VALUES ('0a8213491aaa')")  # an old revision
    with pytest.raises(UserError, match="schema version 0a8213491aaa, expected"):
        prepare_store(uri)


@pytest.mark.slow
def test_ddp_on_cpu_with_a_fresh_sqlite_store_makes_one_run(tmp_path):
    """torchrun, 2 ranks (gloo): only rank zero opens the store (Lightning's logger built an MLflow client, which
    opens and creates the store, on every rank)."""
    from mlflow.tracking import MlflowClient

    args = _tiny_args(tmp_path, "--trainer.max_steps", "4", "--trainer.devices", "2", "--trainer.strategy", "ddp",
                      "--trainer.default_root_dir", str(tmp_path / "runs"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "mhar_lit", "fit", *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("mhar_lit").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["trainer/devices"] == "2" and runs[0].data.params["trainer/strategy"] == "DDPStrategy"


def _runs(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("mhar_lit")
    return client.search_runs([exp.experiment_id]) if exp else []


def test_a_process_that_never_trains_leaves_no_run(tmp_path, monkeypatch):
    """A resume refused on its checkpoint left a FAILED run, `validate` of a checkpoint that does not match a
    FAILED one and `predict` (which logs nothing) a FINISHED one: each empty."""
    from mhar_lit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    first, _ = _fit(_tiny_args(tmp_path, "--trainer.max_steps", "2"))
    ckpt = first.trainer.checkpoint_callback.last_model_path
    before = {r.info.run_id for r in _runs(tmp_path)}
    assert len(before) == 1
    other = ["--model.residual.init_args.heads", "2"]
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        build_cli(["fit", *_tiny_args(tmp_path, "--trainer.max_steps", "4", *other), "--ckpt_path", ckpt])
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        build_cli(["validate", *_tiny_args(tmp_path, *other), "--ckpt_path", ckpt])
    build_cli(["predict", *_tiny_args(tmp_path), "--ckpt_path", ckpt])
    assert {r.info.run_id for r in _runs(tmp_path)} == before
    build_cli(["validate", *_tiny_args(tmp_path), "--ckpt_path", ckpt])  # it logs val/loss: a run
    runs = [r for r in _runs(tmp_path) if r.info.run_id not in before]
    assert len(runs) == 1 and "val/loss" in runs[0].data.metrics
    assert "config.yaml" in {a.path for a in __import__("mlflow").tracking.MlflowClient(
        f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(runs[0].info.run_id)}


def test_resume_appending_to_its_run_keeps_immutable_params(tmp_path, monkeypatch):
    """`--trainer.logger.init_args.run_id` appends to the run; params logged again (the trainer's max_steps
    changed) must not fail: absent ones are added, differing ones kept as they were."""
    monkeypatch.chdir(tmp_path)
    first, _ = _fit(_tiny_args(tmp_path, "--trainer.max_steps", "4"))
    run_id = first.trainer.logger.run_id
    ckpt = first.trainer.checkpoint_callback.last_model_path
    resumed, losses = _fit(_tiny_args(tmp_path, "--trainer.max_steps", "6", "--trainer.logger.init_args.run_id",
                                      run_id), ckpt_path=ckpt)
    assert sorted(losses) == [5, 6] and resumed.trainer.logger.run_id == run_id
    run = [r for r in _runs(tmp_path) if r.info.run_id == run_id][0]
    assert run.info.status == "FINISHED" and run.data.params["trainer/max_steps"] == "4"
    assert len(_runs(tmp_path)) == 1


def test_credentials_in_a_tracking_uri_are_redacted_in_printed_and_uploaded_configs(tmp_path, capsys, monkeypatch):
    from mhar_lit.cli import build_cli
    from mhar_lit.tracking import redact_credentials

    assert redact_credentials("uri: https://user:tok3n@host:5000/x") == "uri: https://user:***@host:5000/x"
    assert redact_credentials("sqlite:///a.db https://host/x user@host") == "sqlite:///a.db https://host/x user@host"
    secret = "https://alice:s3cret-token@mlflow.example.com"
    with pytest.raises(SystemExit):
        build_cli(["--config", str(REPO / "configs/demo.yaml"), "--trainer.logger.init_args.tracking_uri", secret,
                   "--print_config"], run=False)
    printed = capsys.readouterr().out
    assert "s3cret-token" not in printed and "https://alice:***@mlflow.example.com" in printed

    # the uploaded config.yaml: a credential anywhere in the config (here a tag's value) is redacted there too
    monkeypatch.chdir(tmp_path)
    cli, _ = _fit(_tiny_args(tmp_path, "--trainer.max_steps", "1", "--trainer.logger.init_args.tags",
                             f'{{"remote": "{secret}"}}'))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    path = client.download_artifacts(cli.trainer.logger.run_id, "config.yaml", str(tmp_path))
    uploaded = Path(path).read_text()
    assert "s3cret-token" not in uploaded and "https://alice:***@mlflow.example.com" in uploaded


def test_dead_runs_are_marked_killed_and_live_ones_kept(tmp_path):
    from mlflow.tracking import MlflowClient

    from mhar_lit.tracking import process_tags, reap_dead_runs

    client = MlflowClient(f"sqlite:///{tmp_path}/r.db")
    exp = client.create_experiment("r")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    me = process_tags()
    here = socket.gethostname()
    day = 24 * 3600 * 1000
    runs = {
        "gone": {"host": here, "pid": str(proc.pid), "pid_start": ""},
        "alive": me,
        "reused_pid": {**me, "pid_start": me["pid_start"] + "0"},  # our pid, a process started at another time
        "elsewhere_recent": {"host": "another-host", "pid": "1"},
        "elsewhere_stale": {"host": "another-host", "pid": "1"},
    }
    ids = {}
    for name, tags in runs.items():
        start = int(time.time() * 1000) - (2 * day if name == "elsewhere_stale" else 0)
        ids[name] = client.create_run(exp, tags=tags, start_time=start).info.run_id
    killed = set(reap_dead_runs(client, [exp]))
    assert killed == {ids["gone"], ids["reused_pid"], ids["elsewhere_stale"]}
    status = {name: client.get_run(i).info.status for name, i in ids.items()}
    assert status == {"gone": "KILLED", "alive": "RUNNING", "reused_pid": "KILLED", "elsewhere_recent": "RUNNING",
                      "elsewhere_stale": "KILLED"}


def test_a_run_opening_marks_the_dead_runs_of_its_experiment_killed(tmp_path):
    from mlflow.tracking import MlflowClient

    from mhar_lit.lit.mlflow_logger import MLflowRunLogger

    uri = f"sqlite:///{tmp_path}/o.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("o")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = client.create_run(exp, tags={"host": socket.gethostname(), "pid": str(proc.pid)}).info.run_id
    logger = MLflowRunLogger(experiment_name="o", tracking_uri=uri)
    _ = logger.experiment, logger.version  # what the trainer's setup touches: no run yet, nothing reaped
    assert client.get_run(dead).info.status == "RUNNING" and len(client.search_runs([exp])) == 1
    logger.log_metrics({"train/loss": 1.0}, step=0)
    assert client.get_run(dead).info.status == "KILLED"
    tags = client.get_run(logger.run_id).data.tags
    assert tags["pid"] == str(os.getpid()) and tags["host"] == socket.gethostname() and tags["pid_start"]
