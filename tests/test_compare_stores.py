"""`compare` pools several MLflow stores (runs made side by side need one sqlite store each) and refuses an
ambiguous baseline."""

import json

import pytest

from mhar_lit.sweep import DEFAULT_EXPERIMENT, compare_main


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
    with pytest.raises(SystemExit, match="two baseline runs at seed 1 and lr 0.001"):
        compare_main(["--sweep", "pool", "--tracking-uri", a, "--tracking-uri", b])
    with pytest.raises(SystemExit, match="no runs tagged sweep_id='nope'"):
        compare_main(["--sweep", "nope", "--tracking-uri", a])


def test_compare_does_not_create_a_store_at_a_mistyped_uri(tmp_path):
    """MLflow would create typo/dir/ and an empty database there, then report "no runs"."""
    missing = tmp_path / "typo" / "dir" / "mlflw.db"
    with pytest.raises(SystemExit, match=f"no MLflow store at {missing}"):
        compare_main(["--sweep", "x", "--tracking-uri", f"sqlite:///{missing}"])
    with pytest.raises(SystemExit, match="no MLflow store at"):
        compare_main(["--sweep", "x", "--tracking-uri", str(tmp_path / "no-mlruns")])
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
