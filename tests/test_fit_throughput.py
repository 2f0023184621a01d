"""benchmarks/fit_throughput.py: the parsing of SpeedMonitor's MLflow history and the report's arithmetic, and one
real `python -m mhar_lit fit` through the script on the CPU (demo config, tiny batches)."""

import importlib.util
import json
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
def test_demo_fit_end_to_end(tmp_path, capsys, monkeypatch):
    """The script's main in this process (its fit, config print and environment probe are processes of their own,
    as when it runs from the command line)."""
    out = tmp_path / "fit.json"
    args = ["--configs", "demo=configs/demo.yaml", "--max-steps", "6", "--repeats", "1",
            "--warmup", "2", "--allow-dirty", "--out", str(out), "--workdir", str(tmp_path / "work"),
            "--extra", "--data.batch_size 2 --data.seq_len 32 --data.max_corpus_bytes 200000 "
            "--trainer.accumulate_grad_batches 2"]  # accumulation, as in the shipped recipes
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])  # the command line the report records
    returned = load_script().main(args)
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    fit = report["fits"][0]
    assert fit["rc"] == 0 and fit["status"] == "FINISHED", fit.get("error")
    assert "-m mhar_lit fit --config configs/demo.yaml" in fit["command"] and "--speed.every_n_steps 1" in fit["command"]
    # whole optimizer steps are logged at steps 2..5, plus a partial window at step 1 (accumulation);
    # 4 and 5 are after skip_steps (2) + warmup (2)
    assert sorted(int(s) for s in fit["history"]["train/tokens_per_s"]) == [1, 2, 3, 4, 5]
    assert fit["timed_steps"] == 2 and fit["tokens_per_s"] > 0
    shape = report["shapes"]["demo"]
    assert shape["tokens_per_step"] == 2 * 32 * 2 and shape["flops_per_token"] == pytest.approx(shape["flops_per_token_6n"], rel=2e-3)
    labels = report["labels"]["demo"]
    assert labels["tokens_per_s"]["median"] > 0 and labels["fits_ok"] == 1
    assert report["summary"]["demo"]["demo"]["tokens_per_s"] == labels["tokens_per_s"]["median"]
    assert "fit_throughput.py" in report["command"] and "--configs" in report["command"]
    assert report["allow_dirty"] is True and report["commit"] and report["torch"] and report["device"]
    assert "tokens/s median" in printed.splitlines()[-2]


def test_variants_multiply_the_matrix_and_are_interleaved(capsys):
    """--variants: every (size, method) under each variant's overrides, the variants alternating within a repeat;
    a variant without overrides is the unchanged command."""
    ft = load_script()
    args = ft.parse_args(["--sizes", "100M", "--methods", "baseline", "mhar", "--repeats", "2", "--variants", "plain=",
                          "fused+mixed=--model.fused_loss=true --trainer.precision=bf16-mixed"])
    labels = ft.parse_labels(args)
    assert [lb["name"] for lb in labels] == ["100M/baseline+plain", "100M/mhar+plain", "100M/baseline+fused+mixed",
                                             "100M/mhar+fused+mixed"]
    assert labels[2]["overrides"] == ["--model.fused_loss=true", "--trainer.precision=bf16-mixed"]
    assert [lb["name"] for lb, _ in ft.fit_order(labels, 2)] == [lb["name"] for lb in labels] * 2
    ft.main(["--sizes", "100M", "--methods", "baseline", "--repeats", "1", "--dry-run", "--variants", "plain=",
             "fused=--model.fused_loss=true"])
    commands = capsys.readouterr().out.strip().splitlines()
    assert len(commands) == 2 and commands[1] == commands[0].replace("baseline+plain_r0", "baseline+fused_r0") + \
        " --model.fused_loss=true"
    for bad in (["x"], ["a/b=--x"], ["a=", "a=--x"]):
        with pytest.raises(SystemExit, match="--variants"):
            ft.parse_labels(ft.parse_args(["--variants", *bad]))


def _variant_fits(ft):
    labels = [{"name": f"S/{m}+{v}", "size": "S", "method": m, "group": "S", "config": "c", "variant": v,
               "overrides": []} for v in ("a", "b") for m in ("baseline", "mhar")]
    speed = {("baseline", "a"): 100.0, ("mhar", "a"): 90.0, ("baseline", "b"): 120.0, ("mhar", "b"): 114.0}
    fits = [{"label": f"S/{m}+{v}", "repeat": 0, "tokens_per_s": t, "mfu": t / 1000,
             "peak_mem_gib": 2.0 if m == "baseline" else 2.2} for (m, v), t in speed.items()]
    return labels, fits


def test_summary_has_the_issue_format_with_ratios_per_variant():
    """summary[size][method]: medians, ratio against the baseline of the same variant, peak memory ratio, and the
    ratio against the first variant."""
    ft = load_script()
    labels, fits = _variant_fits(ft)
    summary = ft.issue_summary(labels, ft.aggregate(labels, fits))["S"]
    assert summary["mhar+a"] == {"tokens_per_s": 90.0, "mfu": 0.09, "ratio_vs_baseline": pytest.approx(0.9),
                                 "peak_mem_ratio": pytest.approx(1.1), "fits_ok": 1}
    assert summary["mhar+b"]["ratio_vs_baseline"] == pytest.approx(0.95)
    assert summary["mhar+b"]["ratio_vs_a"] == pytest.approx(114.0 / 90.0)
    assert summary["baseline+b"]["ratio_vs_a"] == pytest.approx(1.2)


def test_merge_joins_sizes_and_adds_the_peer(tmp_path):
    """--merge: reports of one device become one (summary per size), --peer adds litgpt's compiled step against
    our baseline; reports of different devices, or of different code, are refused."""
    ft = load_script()
    paths = []
    for size, speed in (("100M", 100.0), ("1B", 20.0)):
        labels = [{"name": f"{size}/baseline", "size": size, "method": "baseline", "group": size, "config": "c"}]
        fits = [{"label": f"{size}/baseline", "repeat": 0, "tokens_per_s": speed, "mfu": 0.4, "peak_mem_gib": 1.0}]
        table = ft.aggregate(labels, fits)
        report = {"device": "GPU X", "commit": "abc", "fits": fits, "shapes": {}, "labels": table,
                  "summary": ft.issue_summary(labels, table)}
        paths.append(tmp_path / f"{size}.json")
        paths[-1].write_text(json.dumps(report))
    peer = {"device": "GPU X", "commit": "abc", "sizes": [
        {"size": "100M", "variants": {"litgpt": {"tokens_per_s": 50.0, "mfu": 0.2},
                                      "litgpt_compile": {"tokens_per_s": 80.0, "mfu": 0.32}}}]}
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    out = tmp_path / "merged.json"
    merged = ft.main(["--merge", *map(str, paths), "--peer", str(tmp_path / "peer.json"), "--out", str(out)])
    assert json.loads(out.read_text()) == merged and merged["device"] == "GPU X" and len(merged["fits"]) == 2
    assert set(merged["summary"]) == {"100M", "1B"} and merged["summary"]["1B"]["baseline"]["tokens_per_s"] == 20.0
    litgpt = merged["summary"]["100M"]["litgpt"]
    assert litgpt["tokens_per_s"] == 80.0 and litgpt["ratio_vs_baseline"] == pytest.approx(0.8)
    other = json.loads(paths[1].read_text())
    paths[1].write_text(json.dumps(dict(other, commit="def")))  # another commit, no digest: refused
    with pytest.raises(SystemExit, match="differ in commit"):
        ft.main(["--merge", *map(str, paths), "--out", str(out)])
    for path, commit in zip(paths, ("abc", "def")):  # another commit of the same measured code: joined
        path.write_text(json.dumps(dict(json.loads(path.read_text()), commit=commit, source_digest="d1")))
    assert ft.main(["--merge", *map(str, paths), "--out", str(out)])["commits"] == ["abc", "def"]
    paths[1].write_text(json.dumps(dict(json.loads(paths[1].read_text()), source_digest="d2")))
    with pytest.raises(SystemExit, match="differ in source_digest"):
        ft.main(["--merge", *map(str, paths), "--out", str(out)])
    paths[1].write_text(json.dumps(dict(other, device="GPU Y")))
    with pytest.raises(SystemExit, match="differ in device"):
        ft.main(["--merge", *map(str, paths), "--out", str(out)])
