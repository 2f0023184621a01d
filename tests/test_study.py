"""benchmarks/study.py on the CPU: two arms run in two pieces (a wall-clock stop after the first step, then a
resume) train exactly as an uninterrupted run, a run of another config is refused, and `report` summarises."""

import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import study  # noqa: E402

BASE = """
seed_everything: 1
trainer: {accelerator: cpu, devices: 1, precision: 32-true, max_steps: 8, val_check_interval: 4,
          check_val_every_n_epoch: null, limit_val_batches: 2, log_every_n_steps: 1, num_sanity_val_steps: 0,
          enable_progress_bar: false}
model: {size: tiny, lr: 3.0e-3, warmup_steps: 2, decay_steps: 8, tail_k: 2}
data: {data: null, tokenizer: bytes, val_fraction: 0.2, seq_len: 32, batch_size: 4, val_batch_size: 4,
       num_workers: 0}
routing_monitor: {every_n_steps: 2}
"""


def _losses(run_dir: Path) -> dict[int, float]:
    """train/loss of every piece in order, keyed by optimizer step (1-based), from the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(study.EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    values = [m.value for r in runs for m in sorted(client.get_metric_history(r.info.run_id, "train/loss"),
                                                    key=lambda m: m.step)]
    return {step + 1: v for step, v in enumerate(values)}


@pytest.mark.slow
def test_run_in_pieces_equals_one_run_and_report(tmp_path):
    base, corpus = tmp_path / "base.yaml", tmp_path / "corpus"
    base.write_text(BASE)
    corpus.mkdir()
    rng, words = random.Random(0), "alpha beta gamma delta routing depth head query".split()
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    common = ["--corpus", str(corpus), "--arms", "baseline,H8-lr", "--seeds", "1", "--base", str(base)]
    # piece 1 asks to stop at once (deadline 0.5 s after the start): each run stops after its first step,
    # validates, checkpoints; piece 2 resumes both to step 8
    assert study.main(["run", *common, "--root", str(tmp_path / "A"), "--until", "8", "--minutes", "3",
                       "--margin", "179.5"]) == 0
    records = {d.name: json.loads((d / "study.json").read_text()) for d in (tmp_path / "A/runs").iterdir()}
    assert set(records) == {"baseline-s1", "H8-lr-s1"} and all(0 < r["step"] < 8 for r in records.values())
    assert study.main(["run", *common, "--root", str(tmp_path / "A"), "--until", "8", "--minutes", "5"]) == 0
    assert study.main(["run", *common, "--root", str(tmp_path / "B"), "--until", "8", "--minutes", "5"]) == 0
    for name in records:
        a, b = tmp_path / "A/runs" / name, tmp_path / "B/runs" / name
        assert json.loads((a / "study.json").read_text())["step"] == 8
        pieced, whole = _losses(a), _losses(b)
        assert sorted(whole) == list(range(1, 9)) and pieced == whole, name  # exact: resume is bitwise on CPU
        assert study.scheduled_validations(a, 4) == study.scheduled_validations(b, 4) != {}
        assert len(list(a.rglob("*.ckpt"))) == 1  # older pieces' checkpoints pruned, the resume point kept
    # a finished run is not started again; another config of the same run folder is refused
    assert study.main(["run", *common, "--root", str(tmp_path / "A"), "--until", "8", "--minutes", "1"]) == 0
    with pytest.raises(SystemExit, match="holds a run of another config .*overrides"):
        study.main(["run", *common, "--root", str(tmp_path / "A"), "--until", "8", "--minutes", "1",
                    "--set", "model.lr=1e-3"])

    assert study.main(["report", "--root", str(tmp_path / "A")]) == 0
    summary = json.loads((tmp_path / "A/summary.json").read_text())
    assert summary["common_step"] == 8
    lr = summary["arms"]["H8-lr"]
    assert lr["routing_lr_sum"]["mean"] == pytest.approx(8 * lr["lr_sum"]["mean"])
    assert 0 < lr["entropy_fraction_of_uniform"]["mean"] < 1
    assert summary["arms"]["baseline"]["entropy_fraction_of_uniform"] is None
    delta = lr["delta_vs_baseline"]["mean"]
    runs = summary["runs"]
    assert delta == pytest.approx(runs["H8-lr-s1"]["tail_mean_val_loss"] - runs["baseline-s1"]["tail_mean_val_loss"])
    assert (tmp_path / "A/loss.png").stat().st_size > 0 and (tmp_path / "A/entropy.png").stat().st_size > 0


def test_corpus_is_deduplicated_with_a_manifest(tmp_path):
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
