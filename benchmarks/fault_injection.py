"""Fault injection for sweeps: SIGKILLs placed where they hurt, every point resumed, nothing lost or changed.

    python benchmarks/fault_injection.py [--seeds 1,2] [--workdir DIR] [--report_only]

1. An uninterrupted sweep (configs/demo.yaml at the tiny size, 12 steps, a validation every 3 steps, a step
   checkpoint every 2; StandardResidual and MHAR x the seeds) into its own sqlite store.
2. The same sweep into another store, where each point's `fit` kills itself (SIGKILL, through the hooks in
   benchmarks/fault_hooks) once, in one of the windows that cost data before:
   - `after_save` at step 6: a step checkpoint at a validating step (the validation of that step was lost);
   - `after_save` at step 2: a step checkpoint before its step's metrics are logged (a train/loss point lost);
   - `after_save` at step 12: after the final checkpoint (the resumed fit ends at once: the run was lost);
   - `in_save` at step 8: inside a checkpoint save (a half-written temp file beside the previous last.ckpt).
   Then `sweep --resume` rounds until every point has finished.
3. `compare` of both sweeps (rows: method, seed, final and tail-mean validation loss; per-method summary) must
   agree to 1e-6 (resume is exact on CPU), every killed point must continue from a checkpoint (a chain of
   more than one run), and the train/loss history of each chain must have every step of the clean run.

Prints `kills: K (resumed from a checkpoint: R), runs lost: L, values differing: D, train/loss points lost: P`
and a JSON line with the same numbers; exits 1 unless K == R and L == D == P == 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).resolve().parent / "fault_hooks"
METHODS = ("baseline", "mhar")
WINDOWS = (("after_save", 6), ("after_save", 2), ("after_save", 12), ("in_save", 8))
MAX_STEPS = 12


def fit_args(workdir: Path) -> list[str]:
    return ["--model.size", "tiny", "--trainer.max_steps", str(MAX_STEPS), "--trainer.val_check_interval", "3",
            "--checkpoint.every_n_train_steps", "2", "--trainer.limit_val_batches", "2",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.warmup_steps", "2", "--model.tail_k", "2",
            "--data.max_corpus_bytes", "300000", "--data.val_fraction", "0.2", "--data.seq_len", "64",
            "--data.batch_size", "4", "--data.val_batch_size", "4", "--data.cache_dir", str(workdir / "cache"),
            "--trainer.default_root_dir", str(workdir / "runs"), "--routing_monitor.every_n_steps", "100"]


def sweep_cmd(sweep_id: str, store: str, workdir: Path, seeds: str, resume: bool = False) -> list[str]:
    methods = ",".join(f"{REPO}/configs/methods/{m}.yaml" for m in METHODS)
    return [sys.executable, "-m", "mhar_lit", "sweep", "--config", str(REPO / "configs/demo.yaml"),
            "--grid", f"config={methods}", "--grid", f"seed_everything={seeds}", "--sweep_id", sweep_id,
            "--tracking_uri", store, "--keep_going", *(["--resume"] if resume else []), "--", *fit_args(workdir)]


def kill_plan(seeds: list[str], done_dir: Path) -> dict:
    """One kill per point, the windows taken in turn."""
    points = [f"{method} seed={seed}" for seed in seeds for method in METHODS]
    kills = [{"run": point, "where": WINDOWS[i % len(WINDOWS)][0], "step": WINDOWS[i % len(WINDOWS)][1]}
             for i, point in enumerate(points)]
    return {"kills": kills, "done_dir": str(done_dir)}


def run(cmd: list[str], env: dict, log: Path) -> int:
    with open(log, "a") as out:
        return subprocess.call(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def compare(sweep_id: str, store: str, env: dict, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "mhar_lit", "compare", "--sweep", sweep_id, "--tracking_uri", store,
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compare {sweep_id} failed:\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    return json.loads(out.read_text())


def finished_table(report: dict) -> dict:
    rows = {(r["method"], r["seed"]): (r["final"], r["tail_mean"]) for r in report["rows"] if r["status"] == "FINISHED"}
    summary = {s["method"]: (s["runs"], s["mean"], s["delta_mean"]) for s in report["summary"]}
    return {"rows": rows, "summary": summary}


def same(a, b, tol: float = 1e-6) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return abs(a - b) <= tol * max(1.0, abs(a)) if isinstance(a, float) else a == b


def train_loss_steps(store: str, run_ids: list[str]) -> set[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    return {m.step for run in run_ids for m in client.get_metric_history(run, "train/loss")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2", help="seeds of the grid (comma-separated)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--report_only", action="store_true",
                        help="compare the two sweeps already in --workdir again, running nothing")
    args = parser.parse_args()
    seeds = [s.strip() for s in args.seeds.split(",") if s.strip()]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault-injection-")).resolve()
    (workdir / "kills").mkdir(parents=True, exist_ok=True)
    plan = workdir / "plan.json"
    plan.write_text(json.dumps(kill_plan(seeds, workdir / "kills"), indent=1))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    faulty_env = {**env, "PYTHONPATH": f"{HOOKS}{os.pathsep}{REPO}", "MHAR_FAULT_PLAN": str(plan)}
    clean, faulty = f"sqlite:///{workdir}/clean.db", f"sqlite:///{workdir}/faulty.db"
    print(f"workdir {workdir}", flush=True)
    start = time.perf_counter()
    if not args.report_only:
        if run(sweep_cmd("clean", clean, workdir, ",".join(seeds)), env, workdir / "clean.log") != 0:
            raise SystemExit(f"the uninterrupted sweep failed; see {workdir}/clean.log")
        rc = run(sweep_cmd("faulty", faulty, workdir, ",".join(seeds)), faulty_env, workdir / "faulty.log")
        for _ in range(len(seeds) * len(METHODS) + 2):
            if rc == 0:
                break
            rc = run(sweep_cmd("faulty", faulty, workdir, ",".join(seeds), resume=True), faulty_env,
                     workdir / "faulty.log")
    rounds = (workdir / "faulty.log").read_text().count("sweep faulty:") - 1

    reference = compare("clean", clean, env, workdir / "clean.json")
    result = compare("faulty", faulty, env, workdir / "faulty.json")
    ref, got = finished_table(reference), finished_table(result)
    if any(v != v for values in ref["rows"].values() for v in values):
        raise SystemExit("the uninterrupted sweep logged no validation loss: nothing to compare")
    lost = [key for key in ref["rows"] if key not in got["rows"]]
    differ = [key for key in ref["rows"] if key in got["rows"] and not same(ref["rows"][key], got["rows"][key])]
    differ += [m for m in ref["summary"] if not same(ref["summary"][m], got["summary"].get(m, ()))]
    kills = sorted((workdir / "kills").glob("kill-*"))
    chains = {(r["method"], r["seed"]): r["runs"] for r in result["rows"]}
    resumed = sum(1 for runs in chains.values() if len(runs) > 1)
    clean_chains = {(r["method"], r["seed"]): r["runs"] for r in reference["rows"]}
    points_lost = sum(len(train_loss_steps(clean, clean_chains[key]) - train_loss_steps(faulty, runs))
                      for key, runs in chains.items() if key in clean_chains)
    summary = {"kills": len(kills), "resumed_from_checkpoint": resumed, "resume_rounds": rounds,
               "runs_lost": len(lost), "values_differing": len(differ), "train_loss_points_lost": points_lost,
               "points": len(ref["rows"]), "seconds": round(time.perf_counter() - start, 1)}
    print(f"kills: {len(kills)} (resumed from a checkpoint: {resumed}), resume rounds: {rounds}, runs lost: "
          f"{len(lost)}, values differing from the uninterrupted sweep: {len(differ)}, train/loss points lost: "
          f"{points_lost}")
    for key in lost + differ:
        print(f"  {key}: {ref['rows'].get(key, ref['summary'].get(key))} vs "
              f"{got['rows'].get(key, got['summary'].get(key))}")
    print(json.dumps(summary), flush=True)
    ok = len(kills) == resumed == len(ref["rows"]) and not lost and not differ and not points_lost
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
