"""benchmarks/decode.py: the CPU dry run writes every case with the fields its JSON promises, a time budget stops
between cases with what was measured saved, and --resume measures only the cases its JSON lacks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import python_path

REPO = Path(__file__).resolve().parents[1]
CASE_KEYS = {"model", "batch", "prompt", "new_tokens", "tokens_per_s", "ttft_ms", "transformers_eager_tokens_per_s",
             "transformers_compiled_tokens_per_s", "transformers_eager_ttft_ms", "same_greedy_tokens"}


def test_dry_run_writes_every_case(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "decode.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode.py"), "--dry-run", "--out", str(out)],
                   check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": python_path()})
    report = json.loads(out.read_text())
    assert report["complete"] and report["dry_run"] and report["device"] and report["commit"]
    assert report["same_tokens_as_eager_mode"] == {"qwen3-0.6b-delta-h8": True, "350M-standard": True,
                                                   "350M-mhar-h8": True}
    for key in ("torch", "transformers", "date", "command"):
        assert report[key]
    cases = report["cases"]
    assert [(c["model"], c["batch"]) for c in cases] == [(m, b) for b in (1, 2) for m in
                                                        ("qwen3-0.6b-delta-h8", "350M-standard", "350M-mhar-h8")]
    for case in cases:
        assert set(case) == CASE_KEYS
        assert case["prompt"] == 8 and case["new_tokens"] == 4
        for key in ("tokens_per_s", "ttft_ms", "transformers_eager_tokens_per_s",
                    "transformers_compiled_tokens_per_s", "transformers_eager_ttft_ms"):
            assert case[key] > 0
    # the converted model at its identity init in fp32 decodes transformers' greedy tokens on every row
    assert [c["same_greedy_tokens"] for c in cases if c["model"].startswith("qwen3")] == [1, 2]
    assert all(c["same_greedy_tokens"] is None for c in cases if not c["model"].startswith("qwen3"))

    # --resume measures only what --out lacks (here the last case), and keeps the rest as it was
    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode

    out.write_text(json.dumps({**report, "cases": cases[:-1], "complete": False}))
    assert decode.main(["--dry-run", "--out", str(out), "--resume"]) == 0
    resumed = json.loads(out.read_text())
    assert resumed["complete"] and resumed["cases"][:-1] == cases[:-1] and len(resumed["cases"]) == len(cases)
    assert (resumed["cases"][-1]["model"], resumed["cases"][-1]["batch"]) == ("350M-mhar-h8", 2)
    assert [call["cases_before"] for call in resumed["calls"]] == [0, 5]
    assert resumed["same_tokens_as_eager_mode"] == report["same_tokens_as_eager_mode"]


def test_resume_refuses_a_report_of_other_settings(tmp_path, capsys):
    """Cases measured with other settings are never mixed in, and the file is left as it was."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode

    out = tmp_path / "decode.json"
    out.write_text(json.dumps({"commit": "0000000", "reps": 3, "grid": {"peers": ["eager"]}, "cases": [{"model": "x"}]}))
    before = out.read_text()
    assert decode.main(["--dry-run", "--out", str(out), "--resume", "--commit", "1111111"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "commit '0000000' there, '1111111' here" in err and "pass another --out" in err
    assert out.read_text() == before


def test_budget_stops_between_cases_and_keeps_what_was_measured():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from decode import case_order, run_cases

    order = case_order(["a", "b"], [1, 16], [128, 1024], [128])
    assert order[:4] == [("a", 1, 128, 128), ("b", 1, 128, 128), ("a", 16, 128, 128), ("b", 16, 128, 128)]
    now = [0.0]
    saved = []

    def measure(model, batch, prompt, new):
        now[0] += 10.0  # every case lasts 10 s
        return {"model": model, "batch": batch}

    report = {"cases": [], "complete": False}
    run_cases(order, measure, report, budget_s=25.0, start=0.0, save=lambda: saved.append(len(report["cases"])),
              clock=lambda: now[0])
    assert len(report["cases"]) == 2 and saved == [1, 2] and not report["complete"]
    assert report["stopped"] == "budget of 25 s reached after 2 of 8 cases"
    report = {"cases": [], "complete": False}
    run_cases(order, measure, report, budget_s=None, start=now[0], save=lambda: None, clock=lambda: now[0])
    assert report["complete"] and len(report["cases"]) == 8


def test_first_token_profile_dry_run_counts_operators(tmp_path):
    """benchmarks/profile_first_token.py on the CPU: each model and its transformers peer once per shape, with the
    wall time and a profile whose operator count and top host operators are filled (no GPU kernels on the CPU)."""
    pytest.importorskip("transformers")
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_first_token.py"), "--dry-run",
                    "--models", "350M-standard", "--out", str(out)],
                   check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": python_path()})
    report = json.loads(out.read_text())
    assert report["commit"] and report["device"]
    assert [(c["model"], c["batch"]) for c in report["cases"]] == [
        (m, b) for b in (1, 2) for m in ("350M-standard", "transformers-350M")]
    for case in report["cases"]:
        assert case["wall_ms"] > 0 and case["profiled_ms"] > 0 and case["cpu_ops"] > 100
        assert case["kernels"] == 0 and case["top_gpu"] == []
        assert len(case["top_host"]) == 12 and all(row["count"] >= 1 for row in case["top_host"])
