"""Fault injection for sweeps: runs killed with SIGKILL at random times, resumed, and nothing lost.

    python benchmarks/fault_injection.py [--kills 4] [--seed 0] [--workdir DIR] [--max_steps 36]

1. An uninterrupted sweep (configs/demo.yaml at a tiny size and few steps, StandardResidual and MHAR x seeds
   1 and 2) into its own sqlite store.
2. The same sweep into another store while `--kills` times a random running `fit` child is killed with
   SIGKILL after a random delay (seeded); `sweep --keep_going` goes on with the next point. Then
   `sweep --resume` rounds (with kills too, until all are spent) until every point has finished: a killed run
   continues from its last.ckpt as a new MLflow run tagged resumed_from_run; one killed before its first
   checkpoint starts again.
3. `compare` of both sweeps: the finished rows (method, seed, final and tail-mean validation loss) and the
   per-method summary must be equal; resume is exact on CPU, so equal to 1e-6.

Prints `kills survived: K, runs lost: L` and exits 1 if a run was lost or a number differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = f"config={REPO}/configs/methods/baseline.yaml,{REPO}/configs/methods/mhar.yaml"


def fit_args(workdir: Path, max_steps: int) -> list[str]:
    return ["--model.size", "tiny", "--trainer.max_steps", str(max_steps), "--trainer.val_check_interval", "3",
            "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--model.warmup_steps", "2", "--model.tail_k", "2",
            "--data.max_corpus_bytes", "300000", "--data.val_fraction", "0.2", "--data.seq_len", "64",
            "--data.batch_size", "4",
            "--data.val_batch_size", "4", "--data.cache_dir", str(workdir / "cache"),
            "--trainer.default_root_dir", str(workdir / "runs")]


def sweep_cmd(sweep_id: str, store: str, workdir: Path, max_steps: int, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "mhar_lit", "sweep", "--config", str(REPO / "configs/demo.yaml"),
            "--grid", METHODS, "--grid", "seed_everything=1,2", "--sweep_id", sweep_id, "--tracking_uri", store,
            "--keep_going", *(["--resume"] if resume else []), "--", *fit_args(workdir, max_steps)]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_with_kills(cmd: list[str], env: dict, rng: random.Random, kills_left: int, log) -> tuple[int, int]:
    """Run a sweep command; each fit child it starts is, while kills are left, marked for a SIGKILL with
    probability 0.7 at a random age of 4-30 s (startup, training, a validation or a checkpoint save: a fit
    here lasts ~20-40 s on 2 cores). Returns (exit code, kills)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    kills, seen, due = 0, set(), {}
    while proc.poll() is None:
        for pid in children(proc.pid):
            if pid not in seen:
                seen.add(pid)
                if kills + len(due) < kills_left and rng.random() < 0.7:
                    due[pid] = time.monotonic() + rng.uniform(4.0, 30.0)
        for pid, when in list(due.items()):
            if time.monotonic() >= when:
                del due[pid]
                if pid in children(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                    print(f"  killed fit pid {pid} ({kills}/{kills_left} this round)", flush=True)
        time.sleep(0.2)
    return proc.returncode, kills


def compare(sweep_id: str, store: str, env: dict, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "mhar_lit", "compare", "--sweep", sweep_id, "--tracking_uri", store,
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compare {sweep_id} failed:\n{done.stderr[-3000:]}")
    print(done.stdout)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=36)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault-injection-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random(args.seed)
    clean, faulty = f"sqlite:///{workdir}/clean.db", f"sqlite:///{workdir}/faulty.db"
    print(f"workdir {workdir}", flush=True)

    with open(workdir / "clean.log", "w") as log:
        rc = subprocess.call(sweep_cmd("clean", clean, workdir, args.max_steps), cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"the uninterrupted sweep failed (rc {rc}); see {workdir}/clean.log")

    kills, rounds = 0, 0
    with open(workdir / "faulty.log", "w") as log:
        rc, k = run_with_kills(sweep_cmd("faulty", faulty, workdir, args.max_steps), env, rng, args.kills, log)
        kills += k
        while rc != 0 or kills < args.kills:
            rounds += 1
            if rounds > 4 * args.kills + 4:
                break
            resume = sweep_cmd("faulty", faulty, workdir, args.max_steps, resume=True)
            rc, k = run_with_kills(resume, env, rng, args.kills - kills, log)
            kills += k
            if k == 0 and rc == 0:
                break

    reference = finished_table(compare("clean", clean, env, workdir / "clean.json"))
    if any(v != v for values in reference["rows"].values() for v in values):
        raise SystemExit("the uninterrupted sweep logged no validation loss: nothing to compare")
    result = finished_table(compare("faulty", faulty, env, workdir / "faulty.json"))
    lost = [key for key in reference["rows"] if key not in result["rows"]]
    differ = [key for key in reference["rows"] if key in result["rows"]
              and not same(reference["rows"][key], result["rows"][key])]
    differ += [m for m in reference["summary"] if not same(reference["summary"][m], result["summary"].get(m, ()))]
    resumed = sum(len(r["runs"]) - 1 for r in json.loads((workdir / "faulty.json").read_text())["rows"])
    print(f"kills survived: {kills} ({resumed} continued from a checkpoint), resume rounds: {rounds}, "
          f"runs lost: {len(lost)}, "
          f"values differing from the uninterrupted sweep: {len(differ)}")
    for key in lost + differ:
        print(f"  {key}: {reference['rows'].get(key, reference['summary'].get(key))} vs "
              f"{result['rows'].get(key, result['summary'].get(key))}")
    return 1 if lost or differ else 0


if __name__ == "__main__":
    sys.exit(main())
