"""benchmarks/fit_throughput.py: the parsing of SpeedMonitor's MLflow history and the report's arithmetic, and one
real `python -m mhar_lit fit` through the script on the CPU (demo config, tiny batches)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "fit_throughput.py"


def load_script():
    spec = importlib.util.spec_from_file_location("fit_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steady_state_skips_warmup_and_summarises():
    ft = load_script()
    history = {ft.SPEED_KEY: {2: 10.0, 3: 50.0, 4: 100.0, 5: 120.0, 6: 110.0},
               ft.MEMORY_KEY: {2: 1.0, 6: 1.5}, ft.RUN_MFU_KEY: {}}
    out = ft.summarise_fit(history, first_step=4, flops_per_token=2.0, peak_flops=1000.0, tokens_per_step=55)
    assert out["timed_steps"] == 3
    assert out["tokens_per_s"] == 110.0 and out["tokens_per_s_min"] == 100.0 and out["tokens_per_s_max"] == 120.0
    assert out["step_ms"] == pytest.approx(1e3 * 55 / 110.0)
    assert out["mfu"] == pytest.approx(2.0 * 110.0 / 1000.0)
    assert out["peak_mem_gib"] == 1.5
    with pytest.raises(RuntimeError, match="raise --max-steps"):
        ft.summarise_fit(history, first_step=7, flops_per_token=None, peak_flops=None, tokens_per_step=None)


def test_ratios_against_the_baseline_of_each_size():
    ft = load_script()
    labels = [{"name": f"S/{m}", "size": "S", "method": m, "group": "S", "config": "c"} for m in ("baseline", "mhar")]
    fits = [{"label": "S/baseline", "repeat": r, "tokens_per_s": t, "peak_mem_gib": 2.0} for r, t in ((0, 100.0), (1, 120.0))]
    fits += [{"label": "S/mhar", "repeat": r, "tokens_per_s": t, "peak_mem_gib": 2.1} for r, t in ((0, 90.0), (1, 96.0))]
    fits.append({"label": "S/mhar", "repeat": 2, "error": "boom"})
    summary = ft.aggregate(labels, fits)
    mhar = summary["S/mhar"]
    assert (mhar["fits_ok"], mhar["fits_failed"]) == (2, 1)
    assert mhar["tokens_per_s_vs_baseline"] == pytest.approx(93.0 / 110.0)
    assert mhar["tokens_per_s_vs_baseline_paired"]["repeats"] == pytest.approx([0.9, 0.8])
    assert mhar["peak_mem_gib_vs_baseline"] == pytest.approx(1.05)
    assert [(lb["method"], r) for lb, r in ft.fit_order(labels, 2)] == [("baseline", 0), ("mhar", 0), ("baseline", 1), ("mhar", 1)]


def test_bad_configs_argument_is_refused():
    ft = load_script()
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        ft.parse_labels(ft.parse_args(["--configs", "configs/demo.yaml"]))
    with pytest.raises(SystemExit, match="not found"):
        ft.parse_labels(ft.parse_args(["--configs", "x=configs/none.yaml"]))


@pytest.mark.slow
def test_demo_fit_end_to_end(tmp_path):
    out = tmp_path / "fit.json"
    cmd = [sys.executable, str(SCRIPT), "--configs", "demo=configs/demo.yaml", "--max-steps", "6", "--repeats", "1",
           "--warmup", "2", "--allow-dirty", "--out", str(out), "--workdir", str(tmp_path / "work"),
           "--extra", "--data.batch_size 2 --data.seq_len 32 --data.max_corpus_bytes 200000 "
           "--trainer.accumulate_grad_batches 2"]  # accumulation, as in the shipped recipes
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    fit = report["fits"][0]
    assert fit["rc"] == 0 and fit["status"] == "FINISHED", fit.get("error")
    assert "-m mhar_lit fit --config configs/demo.yaml" in fit["command"] and "--speed.every_n_steps 1" in fit["command"]
    # whole optimizer steps are logged at steps 2..5, plus a partial window at step 1 (accumulation);
    # 4 and 5 are after skip_steps (2) + warmup (2)
    assert sorted(int(s) for s in fit["history"]["train/tokens_per_s"]) == [1, 2, 3, 4, 5]
    assert fit["timed_steps"] == 2 and fit["tokens_per_s"] > 0
    shape = report["shapes"]["demo"]
    assert shape["tokens_per_step"] == 2 * 32 * 2 and shape["flops_per_token"] == pytest.approx(shape["flops_per_token_6n"], rel=2e-3)
    summary = report["summary"]["demo"]
    assert summary["tokens_per_s"]["median"] > 0 and summary["fits_ok"] == 1
    assert "fit_throughput.py" in report["command"] and "--configs" in report["command"]
    assert report["allow_dirty"] is True and report["commit"] and report["torch"] and report["device"]
    assert "tokens/s median" in done.stdout.splitlines()[-2]
