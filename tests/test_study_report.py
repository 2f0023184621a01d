"""benchmarks/study_report.py on synthetic exports: tail-means, paired deltas (at the fewer steps of a pair when a
run was cut short), seed spread, summed lr of the study and of the paper, the table, the plots, and refusals."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import study_report  # noqa: E402

SCHEDULE = {"lr": 1e-3, "warmup_steps": 10, "decay_steps": 50, "min_lr_ratio": 0.1, "max_steps": 50}
OFFSET = {"baseline": 0.3, "H1": 0.1, "H8": 0.2, "H8-heads": 0.05}  # each arm's loss above a shared curve


def _run(arm, seed, step=50, corpus="c0"):
    """A run whose val loss at step s is 3 - s/100 + its arm's offset + 0.01 x seed, entropy falling with steps."""
    val = [[s, 3 - s / 100 + OFFSET[arm] + 0.01 * seed] for s in range(10, step + 1, 10)]
    entropy = [] if arm == "baseline" else [[s, 1 - s / 100] for s in range(5, step + 1, 5)]
    lr_sum = [[s, s * 1e-3] for s in range(5, step + 1, 5)]
    return {"arm": arm, "seed": seed, "step": step, "validation_every": 10, "tail_k": 3, "val": val,
            "identity": {"corpus_sha256": corpus, "base_sha256": "b0", "precision": "bf16-true"},
            "pieces": [{"rc": 0}], "mlflow_runs": [],
            "metrics": {"entropy": entropy, "lr_sum": lr_sum, "routing_lr_sum": [], "train_loss": [],
                        "logit_spread": [], "tokens_per_s": []}, "log_tail": []}


def _export(path, runs, commit="c0ffee1"):
    path.write_text(json.dumps({"set": path.stem, "piece": {"commit": commit}, "schedule": SCHEDULE, "runs": runs}))
    return path


def test_summary_table_and_plots_from_synthetic_exports(tmp_path):
    exports = tmp_path / "exports"
    exports.mkdir()
    _export(exports / "study-a1.json", [_run(a, 1) for a in OFFSET])
    # seed 2: H8-heads cut short at step 30 by its budget; a stale first-piece export of H1 s2 loses to the later one
    _export(exports / "study-a2.json", [_run("baseline", 2), _run("H1", 2), _run("H8-heads", 2, step=30)])
    _export(exports / "study-a2-piece1.json", [_run("H1", 2, step=20)])
    summary = study_report.write_report([exports], tmp_path / "out")

    assert summary["commit"] == "c0ffee1" and summary["tail_k"] == 3
    heads, base, h1 = summary["arms"]["H8-heads"], summary["arms"]["baseline"], summary["arms"]["H1"]
    # H8-heads: its steps are the fewest of its seeds (30): tail-mean of steps 10, 20, 30 = 3 - 0.2 + 0.05 + 0.01 s
    assert heads["steps"] == 30 and heads["seeds"] == [1, 2]
    assert heads["tail_mean"] == pytest.approx([2.86, 2.87])
    # paired deltas are the offsets' differences, at step 50 for seed 1 and at step 30 for seed 2
    assert heads["delta_vs_baseline"] == pytest.approx([-0.25, -0.25])
    assert heads["delta_vs_baseline_steps"] == [50, 30]
    assert heads["delta_vs_H1"] == pytest.approx([-0.05, -0.05])
    assert base["delta_vs_baseline"] == pytest.approx([0.0, 0.0]) and base["steps"] == 50
    assert h1["tail_mean"] == pytest.approx([3 - 0.4 + 0.1 + 0.01, 3 - 0.4 + 0.1 + 0.02])  # the step-50 export won
    assert summary["arms"]["H8"]["seeds"] == [1] and summary["arms"]["H8"]["delta_vs_H1"] == pytest.approx([0.1])
    assert heads["tail_mean_spread"]["max"] - heads["tail_mean_spread"]["min"] == pytest.approx(0.01)
    assert heads["entropy"] == pytest.approx([0.7, 0.7]) and base["entropy"] == [None, None]
    assert heads["lr_sum"] == pytest.approx([0.03, 0.03]) and heads["routing_lr_sum"] == heads["lr_sum"]
    # the paper's 20K steps at 5e-4: 5e-4 x (500.5 warmup + 19000 x 0.55 + 0.45 from the cosine's half period)
    assert summary["lr_sum_paper"] == pytest.approx(5e-4 * (500.5 + 10450 + 0.45), rel=1e-4)
    assert summary["lr_sum_planned"] == pytest.approx(1e-3 * (5.5 + 40 * 0.55 + 0.45), rel=1e-3)

    out = tmp_path / "out"
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    table = (out / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| H8-heads |"))
    assert "| 30 |" in row and "-0.2500 / -0.2500 (mean -0.2500)" in row and "0.0100" in row
    assert "| baseline |" in table and "5.48" in table
    assert (out / "loss.png").stat().st_size > 10_000 and (out / "entropy.png").stat().st_size > 10_000


def test_mixed_corpora_and_missing_exports_are_refused(tmp_path):
    _export(tmp_path / "study-a1.json", [_run("baseline", 1)])
    _export(tmp_path / "study-b1.json", [_run("H1", 1, corpus="other")])
    with pytest.raises(SystemExit, match="mix runs of 2 different corpus"):
        study_report.write_report([tmp_path], tmp_path / "out")
    with pytest.raises(SystemExit, match="no study exports"):
        study_report.write_report([tmp_path / "empty"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
