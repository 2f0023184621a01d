"""GPU check of `model.cuda_graph: true` through the real command line: `python -m mhar_lit fit` on the
replication recipe (configs/replication/base.yaml: 100M, the embedded corpus streamed by litdata, MLflow in
sqlite, validation, routing monitor, checkpoints) with and without capture, per method overlay
(configs/methods/*.yaml). Same seed and data; the per-step training losses are read back from each run's
MLflow store and compared, and the logged throughput of the two runs is reported. With --control a second
eager fit gives the eager-vs-eager difference (bf16 GPU training is not bitwise reproducible), the yardstick
for the captured run's.

    python benchmarks/cli_graph_check.py [--methods hc mhar] [--steps 120] [--out DIR] [--control]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run_fit(method: str, graph: bool, steps: int, out: str, extra: list[str], tag: str = "") -> dict:
    store = os.path.join(out, f"{method}_{'graph' if graph else 'eager'}{tag}")
    os.makedirs(store, exist_ok=True)
    uri = "sqlite:///" + os.path.abspath(os.path.join(store, "mlflow.db"))
    half = max(1, steps // 2)
    cmd = [sys.executable, "-m", "mhar_lit", "fit", "--config", "configs/replication/base.yaml",
           "--config", f"configs/methods/{method}.yaml", "--model.cuda_graph", str(graph).lower(),
           "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(half),
           "--trainer.limit_val_batches", "4", "--routing_monitor.every_n_steps", str(half),
           "--speed.every_n_steps", "10", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", os.path.join(store, "runs"),
           "--data.cache_dir", os.path.join(out, "data_cache"), *extra]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, MLFLOW_TRACKING_URI=uri))
    with open(os.path.join(store, "fit.log"), "w") as f:
        f.write(" ".join(shlex.quote(c) for c in cmd) + "\n" + done.stdout + done.stderr)
    result = {"method": method, "cuda_graph": graph, "rc": done.returncode, "wall_s": time.time() - t0,
              "command": " ".join(shlex.quote(c) for c in cmd)}
    if done.returncode != 0:
        result["error"] = (done.stdout + done.stderr)[-2000:]
        return result
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    history = lambda key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}  # noqa: E731
    result.update(losses=history("train/loss"), val=history("val/loss"), tokens_per_s=history("train/tokens_per_s"))
    return result


def loss_diffs(a: dict, b: dict) -> tuple[float, float, int]:
    """Largest relative difference of two runs' per-step training losses and of their validation losses."""
    steps = sorted(set(a["losses"]) & set(b["losses"]))
    diff = max(abs(a["losses"][s] - b["losses"][s]) / abs(a["losses"][s]) for s in steps)
    val_steps = sorted(set(a["val"]) & set(b["val"]))
    val_diff = max((abs(a["val"][s] - b["val"][s]) / a["val"][s] for s in val_steps), default=float("nan"))
    return diff, val_diff, len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["hc", "mhar"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="cli_graph_check")
    parser.add_argument("--extra", default="", help="more CLI arguments for every fit (e.g. a CPU smoke test)")
    parser.add_argument("--eager-only", action="store_true", help="CPU smoke test of this script: no capture")
    parser.add_argument("--control", action="store_true", help="also a second eager fit (eager-vs-eager diff)")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    import torch

    os.makedirs(args.out, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                  date=dt.datetime.now().isoformat(timespec="seconds"),
                  command=" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), runs=[])
    rows = []
    for method in args.methods:
        extra = shlex.split(args.extra)
        eager = run_fit(method, False, args.steps, args.out, extra)
        graph = eager if args.eager_only else run_fit(method, True, args.steps, args.out, extra)
        control = run_fit(method, False, args.steps, args.out, extra, tag="2") if args.control else None
        report["runs"] += [eager, graph] + ([control] if control else [])
        failed = [r for r in (eager, graph, control) if r and r["rc"]]
        if failed:
            rows.append(f"{method:9s} FAILED (rc {[r['rc'] for r in failed]}): {failed[0].get('error', '')[-300:]}")
            continue
        diff, val_diff, n_steps = loss_diffs(eager, graph)
        speed = [statistics.median(list(r["tokens_per_s"].values())[1:] or [float("nan")]) for r in (eager, graph)]
        rows.append(f"{method:9s} steps {n_steps:4d}  max rel train-loss diff {diff:.1e}  val diff {val_diff:.1e}  "
                    f"tok/s eager {speed[0]:9.0f} graph {speed[1]:9.0f} ({speed[1] / speed[0]:.2f}x)")
        if control:
            diff, val_diff, n_steps = loss_diffs(eager, control)
            rows.append(f"{method:9s} control: eager vs eager  max rel train-loss diff {diff:.1e}  "
                        f"val diff {val_diff:.1e}")
        with open(os.path.join(args.out, "cli_graph_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "cli_graph_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
