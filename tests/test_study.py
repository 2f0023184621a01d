"""benchmarks/study.py on the CPU: a set run as two budgeted pieces (the first stopped by its budget after one step,
the second resuming it) trains exactly as one uninterrupted piece, and exports what the report reads; every arm
resolves to the options it claims; a run of another config is refused."""

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import study  # noqa: E402

# arm -> (heads, logit_scale, routing_lr_scale, precision) over the tiny base; None heads: the standard residual
ARM_OPTIONS = {
    "baseline": (None, None, 1.0, "32-true"), "H1": (1, None, 1.0, "32-true"), "H8": (8, None, 1.0, "32-true"),
    "H8-heads": (8, "heads", 1.0, "32-true"), "H4-heads": (4, "heads", 1.0, "32-true"),
    "H16-heads": (16, "heads", 1.0, "32-true"), "H8-lr": (8, None, 8.0, "32-true"),
    "H1-lr": (1, None, 8.0, "32-true"), "H8-sqrt": (8, "sqrt_heads", 1.0, "32-true"),
    "H8-bf16": (8, None, 1.0, "bf16-true"),
}


def _losses(run_dir: Path) -> dict[int, float]:
    """train/loss of every piece in order, keyed by optimizer step (1-based), from the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(study.EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    values = [m.value for r in runs for m in sorted(client.get_metric_history(r.info.run_id, "train/loss"),
                                                    key=lambda m: m.step)]
    return {step + 1: v for step, v in enumerate(values)}


def test_every_arm_resolves_to_its_options_and_every_set_names_known_arms(capsys):
    """Each arm over the tiny base gives the strategy, logit scale, routing lr scale and precision it claims; the
    sets hold the issue's eight arms at two seeds plus the extras, at most four runs each."""
    from mhar_lit.cli import build_cli

    assert set(study.ARMS) == set(ARM_OPTIONS)
    assert {p.stem for p in study.ARMS_DIR.glob("*.yaml")} <= set(study.ARMS)  # no arm file left unused
    for arm, (heads, logit_scale, lr_scale, precision) in ARM_OPTIONS.items():
        with pytest.raises(SystemExit):
            build_cli(["--config", str(study.TINY_BASE), "--config", str(REPO / study.ARMS[arm]), "--print_config"],
                      run=False)
        captured = capsys.readouterr()
        config = yaml.safe_load(captured.out)
        assert isinstance(config, dict), f"{arm} does not parse: {captured.err.strip()[-400:]}"
        residual = config["model"]["residual"]
        init = residual.get("init_args") or {}
        assert residual["class_path"].endswith("StandardResidual" if heads is None else "FullAttnRes"), arm
        assert (init.get("heads"), init.get("logit_scale")) == ((heads, logit_scale) if heads else (None, None)), arm
        lr = init.get("routing_lr_scale", config["model"].get("routing_lr_scale", 1.0))
        assert (lr, config["trainer"]["precision"]) == (lr_scale, precision), arm
        assert study.arm_precision(study.DEFAULT_BASE, arm) == ("bf16-true" if arm == "H8-bf16" else "bf16-mixed")
    runs = [study.parse_run(item) for items in study.SETS.values() for item in items]
    assert all(len(items) <= 4 for items in study.SETS.values()) and len(set(runs)) == len(runs)
    main_arms = {"baseline", "H1", "H8", "H8-heads", "H8-lr", "H1-lr", "H4-heads", "H16-heads"}
    assert {(a, s) for a in main_arms for s in (1, 2)} <= set(runs)
    assert {a for a, _ in runs} == set(ARM_OPTIONS)


def test_dry_run_prints_each_runs_fit_with_its_arm_tag(tmp_path, capsys):
    assert study.main(["piece", "x", "--dry-run", "--out", str(tmp_path), "--root", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    fits = [line for line in lines if " -m mhar_lit fit " in line]
    assert len(fits) == 3 and not (tmp_path / "r").exists()  # nothing built, nothing run
    assert '"study_arm": "H8-bf16"' in fits[0] and "configs/study/arms/H8-bf16.yaml" in fits[0]
    assert "--seed_everything 2" in fits[2] and "configs/study/arms/H8-sqrt.yaml" in fits[2]
    with pytest.raises(SystemExit, match="no set 'zz'"):
        study.main(["piece", "zz", "--dry-run", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown arm 'H9'"):
        study.main(["piece", "H9:1", "--dry-run", "--out", str(tmp_path)])


def _fit_uninterrupted_in_this_process(root: Path, corpus: Path, runs: list[tuple[str, int]]) -> None:
    """The reference for the pieces: each run's whole fit as a piece of `root` would start it (study.fit_command
    of the run's identity and folders, its stop request never reached), in this process, in the run's folder. The
    pieces under test stay the study's own processes; a process per reference run would add ~12 s of Lightning's
    import each and check nothing more."""
    import contextlib
    import time

    from mhar_lit.cli import build_cli

    manifest = study.build_corpus(corpus, max_bytes=study.TINY_CORPUS_BYTES)  # built by the pieces: read here
    for arm, seed in runs:
        identity = study.run_identity(study.TINY_BASE.resolve(), arm, seed, corpus, manifest, [])
        run_dir, _ = study.prepare_run_dir(root, identity)
        command = study.fit_command(run_dir, identity, time.time() + 3600, root / "data_cache", None)
        with contextlib.chdir(run_dir):
            build_cli(command[command.index("fit"):])


@pytest.mark.slow
def test_tiny_set_in_two_budgeted_pieces_equals_one_piece_and_exports(tmp_path):
    corpus = tmp_path / "corpus"
    common = ["baseline:1,H8-heads:1", "--tiny", "--corpus", str(corpus), "--commit", "abc1234"]
    piece_a = ["piece", *common, "--root", str(tmp_path / "A"), "--out", str(tmp_path / "outA")]
    # piece 1's budget asks the runs to stop 0.5 s after its start: each stops after its first step, validates and
    # checkpoints; piece 2 resumes both to the tiny base's 8 steps
    assert study.main([*piece_a, "--budget_s", "300", "--margin_s", "299.5"]) == 0
    records = {d.name: json.loads((d / "study.json").read_text()) for d in (tmp_path / "A/runs").iterdir()}
    assert set(records) == {"baseline-s1", "H8-heads-s1"} and all(0 < r["step"] < 8 for r in records.values())
    assert study.main(piece_a) == 0
    _fit_uninterrupted_in_this_process(tmp_path / "B", corpus, [("baseline", 1), ("H8-heads", 1)])
    for name in records:
        a, b = tmp_path / "A/runs" / name, tmp_path / "B/runs" / name
        record = json.loads((a / "study.json").read_text())
        assert record["step"] == 8 and [p["rc"] for p in record["pieces"]] == [0, 0]
        pieced, whole = _losses(a), _losses(b)
        assert sorted(whole) == list(range(1, 9)) and pieced == whole, name  # exact: resume is bitwise on CPU
        assert study.scheduled_validations(a, 4) == study.scheduled_validations(b, 4) != {}
        assert len(list(a.rglob("*.ckpt"))) == 1  # older pieces' checkpoints pruned, the resume point kept

    label = "baseline-s1_H8-heads-s1"
    out = sorted(p.name for p in (tmp_path / "outA").iterdir())
    assert out == sorted(f"{stem}-{label}.{ext}" for stem, ext in
                         (("study", "json"), ("summary", "json"), ("table", "md"), ("loss", "png"), ("entropy", "png")))
    export = json.loads((tmp_path / "outA" / f"study-{label}.json").read_text())
    assert export["piece"]["commit"] == "abc1234" and export["schedule"]["max_steps"] == 8
    runs = {f"{r['arm']}-s{r['seed']}": r for r in export["runs"]}
    heads = runs["H8-heads-s1"]
    assert [s for s, _ in heads["val"]] == [4, 8] and len(heads["mlflow_runs"]) == 2
    assert {r["study_arm"] for r in heads["mlflow_runs"]} == {"H8-heads"}
    assert [s for s, _ in heads["metrics"]["entropy"]] == [1, 2, 4, 6, 8]  # the monitor also logs at piece 1's stop
    assert 0 < heads["metrics"]["entropy"][-1][1] < 1 and runs["baseline-s1"]["metrics"]["entropy"] == []
    assert heads["metrics"]["lr_sum"][-1][0] == 8 and heads["log_tail"]
    summary = json.loads((tmp_path / "outA" / f"summary-{label}.json").read_text())
    arm = summary["arms"]["H8-heads"]
    assert arm["steps"] == 8 and arm["delta_vs_baseline"][0] == pytest.approx(
        arm["tail_mean"][0] - summary["arms"]["baseline"]["tail_mean"][0])
    assert arm["delta_vs_H1"] == [None]

    # a finished run is not started again; another config of the same run folder is refused
    assert study.main(piece_a) == 0
    assert [len(json.loads((tmp_path / "A/runs" / n / "study.json").read_text())["pieces"]) for n in records] == [2, 2]
    with pytest.raises(SystemExit, match="holds a run of another config .*overrides"):
        study.main([*piece_a, "--fit", "model.lr=1e-3"])


def test_corpus_is_deduplicated_capped_and_fingerprinted(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    (src / "pkg" / "copy.py").write_text("x = 1\n")  # same content: one document
    (src / "README.md").write_text("# hi\n")
    (src / "api.h").write_text("int f(void);\n")
    (src / "blob.bin").write_bytes(b"\0\1")
    (src / "latin.txt").write_bytes(b"caf\xe9")
    manifest = study.build_corpus(tmp_path / "out", roots=[src])
    assert manifest["unique_docs"] == 3 and manifest["duplicates"] == 1 and manifest["skipped_not_utf8"] == 1
    assert manifest["bytes"] == len("x = 1\n") + len("# hi\n") + len("int f(void);\n")
    docs = [json.loads(line) for f in sorted((tmp_path / "out").glob("part-*.jsonl")) for line in f.open()]
    assert sorted(d["text"] for d in docs) == ["# hi\n", "int f(void);\n", "x = 1\n"]
    assert study.build_corpus(tmp_path / "out", roots=[]) == manifest  # complete: not built again
    # sorted order is README.md, a.py, api.h: a cap of 11 bytes takes the first two and stops before the third
    capped = study.build_corpus(tmp_path / "capped", roots=[src], max_bytes=11)
    assert capped["unique_docs"] == 2 and capped["bytes"] == 11
    assert capped["content_sha256"] != manifest["content_sha256"]
    assert study.build_corpus(tmp_path / "again", roots=[src])["content_sha256"] == manifest["content_sha256"]
