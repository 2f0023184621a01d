"""benchmarks/lost_updates.py on the CPU: under bf16-true an AdamW step of lr 1e-3 leaves every RMSNorm gain at its
initial 1.0 (under half a bf16 ulp), while fp32 weights with bf16 autocast move all of them; the other weights
move under both."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lost_updates.py"


def test_bf16_true_cannot_move_a_norm_gain_that_bf16_mixed_moves(tmp_path):
    spec = importlib.util.spec_from_file_location("lost_updates", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    report = script.main(["--lrs", "1e-3", "--steps", "1", "--out", str(tmp_path / "lost.json")])
    runs = {run["precision"]: run["fraction_moved"] for run in report["runs"]}
    assert runs["bf16-true"]["norm gain"] == 0.0 and runs["bf16-mixed"]["norm gain"] == 1.0
    assert runs["bf16-true"]["other"] > 0.9 and runs["bf16-mixed"]["other"] > 0.9
    assert json.loads((tmp_path / "lost.json").read_text())["runs"] == report["runs"]
