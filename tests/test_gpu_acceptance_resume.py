"""benchmarks/gpu_acceptance.py resumes on a warm machine: a later call at the same commit, device and torch carries
over the cases an earlier call passed and runs the rest; anything else starts afresh. Also the groups it runs and the
generate case's rule for greedy tokens that differ by a tie."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.py"
HEADER = {"commit": "abc1234", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "date": "2026-12-07T15:00:00",
          "command": "benchmarks/gpu_acceptance.py"}


def _script():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _earlier_call(work: Path) -> None:
    cases = [{"name": "fit 100M baseline", "passed": True, "detail": "captured path", "seconds": 40.0},
             {"name": "fit 100M hc", "passed": False, "detail": "not run: the budget (--budget-s) was spent",
              "seconds": 0.0}]
    (work / "acceptance.json").write_text(json.dumps({**HEADER, "complete": True, "passed": False, "cases": cases}))


def test_a_later_call_carries_the_passed_cases_and_runs_the_rest(tmp_path):
    script = _script()
    _earlier_call(tmp_path)
    later = {**HEADER, "date": "2026-12-07T15:10:00"}
    acc = script.Acceptance(str(tmp_path), 100, later, [str(tmp_path / "report.json")])
    ran = []
    acc.run = lambda cmd, timeout, log, env=None: (ran.append(cmd), (0, "training steps: captured (CUDA graphs)\n"
                                                                    "  train/loss 5.5   1,000 tokens/s", 1.0))[1]
    script.fit_case(acc, "100M", "baseline")
    script.fit_case(acc, "100M", "hc")
    assert len(ran) == 1 and "configs/methods/hc.yaml" in ran[0]
    report = acc.write(complete=True)
    assert report["passed"] and [c["name"] for c in report["cases"]] == ["fit 100M baseline", "fit 100M hc"]
    assert report["cases"][0]["carried_from"] == HEADER["date"] and "carried_from" not in report["cases"][1]
    kept = json.loads((tmp_path / "acceptance.json").read_text())  # a third call would carry both
    assert [c["name"] for c in kept["cases"] if c["passed"]] == ["fit 100M baseline", "fit 100M hc"]
    third = script.Acceptance(str(tmp_path), 100, {**HEADER, "date": "2026-12-07T15:20:00"}, [])
    assert third.earlier["fit 100M baseline"]["carried_from"] == HEADER["date"]


def test_another_commit_or_device_carries_nothing(tmp_path):
    script = _script()
    _earlier_call(tmp_path)
    for change in ({"commit": "def5678"}, {"device": "NVIDIA H200"}, {"torch": "2.12.0"}, {"commit": "unknown"}):
        assert script.Acceptance(str(tmp_path), 100, {**HEADER, **change}, []).earlier == {}
    assert script.Acceptance(str(tmp_path / "absent"), 100, HEADER, []).earlier == {}


def test_case_logs_carry_each_line_s_time_and_a_case_past_its_time_is_killed(tmp_path):
    script = _script()
    acc = script.Acceptance(str(tmp_path), 100, HEADER, [str(tmp_path / "report.json")])
    rc, log, _ = acc.run([sys.executable, "-c", "print('FAILED tests/x.py::a'); print('1 failed')"], 30,
                         str(tmp_path / "a.log"))
    assert rc == 0 and all(script.TIME_PREFIX.match(line) for line in log.splitlines())
    acc.run = lambda cmd, timeout, log_path, env=None: (1, log, 1.0)
    script.gpu_tests(acc, "tests: a group", ["tests/x.py"], {})
    assert acc.cases[-1]["detail"] == "FAILED tests/x.py::a\n1 failed"  # found behind the time prefix
    acc = script.Acceptance(str(tmp_path), 100, HEADER, [])
    rc, _, seconds = acc.run([sys.executable, "-c", "import time; time.sleep(30)"], 1, str(tmp_path / "b.log"))
    assert rc == 124 and seconds < 20


def test_the_routing_matrix_splits_by_dtype_only_on_a_large_card_and_the_small_shape_runs_apart():
    """Two matrix processes hold two sets of float64 references: only where the memory is there for both."""
    script = _script()
    small, large = script.gpu_test_groups(80), script.gpu_test_groups(140)
    narrow = {"tests: GPU routing matrix, small model": ["tests/test_gpu_routing_matrix.py", "-k", "narrow"]}
    whole = {name: files for name, (files, _) in small.items() if "matrix" in name}
    assert whole == {"tests: GPU routing matrix": ["tests/test_gpu_routing_matrix.py", "-k", "not narrow"], **narrow}
    split = {name: files for name, (files, _) in large.items() if "matrix" in name}
    assert split == {**{f"tests: GPU routing matrix {d}": ["tests/test_gpu_routing_matrix.py", "-k", f"{d} and not narrow"]
                        for d in ("fp32", "bf16")}, **narrow}
    assert small["tests: CUDA graph and generation"] == large["tests: CUDA graph and generation"]
    files, env = small["tests: compiled fused ops and generation"]  # compiled, as users run them
    assert env == {"TRITON_INTERPRET": "0"}
    assert files[:2] == ["tests/test_fused_ops_gpu.py", "tests/test_decode_paths.py"]


def test_each_fit_starts_from_a_copy_of_one_migrated_mlflow_store(tmp_path):
    """The store's tables are made once (store_template); every fit's sqlite store is a copy, which MLflow opens
    without creating tables again and records runs in."""
    import mlflow

    script = _script()
    acc = script.Acceptance(str(tmp_path), 100, HEADER, [])
    acc.store_template = script.store_template(str(tmp_path))
    assert acc.store_template and Path(acc.store_template).stat().st_size > 0
    seen = []

    def run(cmd, timeout, log_path, env=None):
        seen.append((tmp_path / "100M-hc.db").exists())
        return 1, "", 0.0
    acc.run = run
    script.fit_case(acc, "100M", "hc")
    assert seen == [True] and not acc.cases[-1]["passed"]  # the store was there before the fit started
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / '100M-hc.db'}")
    run = client.create_run(client.create_experiment("fit"))
    client.log_metric(run.info.run_id, "train/loss", 1.0)
    assert client.get_run(run.info.run_id).data.metrics == {"train/loss": 1.0}


def test_greedy_gaps_pass_greedy_tokens_and_name_a_wrong_one():
    """The generate case's fallback when the GPU's token ids differ from the CPU's: the GPU's tokens must be the CPU
    full forward's greedy choices up to ties. Greedy tokens from the cached loop have gap 0 (to rounding); one token
    replaced by the forward's least likely is far over the tie bound."""
    import torch

    from mhar_lit.generation import generate
    from mhar_lit.config import ModelConfig
    from mhar_lit.models.decoder import DecoderLM
    from mhar_lit.residual import FullAttnRes

    script = _script()
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_name("tiny-4l"), FullAttnRes(heads=4)).eval()
    prompts = [[5, 9, 2, 7], [3, 1]]
    rows = generate(model, prompts, 8)
    assert max(script.greedy_gaps(model, prompts, rows)) <= 1e-5
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1] + rows[1][:3]]))[0, -1]
    wrong = [rows[0], rows[1][:3] + [int(logits.argmin())] + rows[1][4:]]
    gaps = script.greedy_gaps(model, prompts, wrong)
    assert gaps[0] <= 1e-5 and gaps[1] > 100 * script.GREEDY_TIE
