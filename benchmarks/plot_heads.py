"""Results table and H-sweep plot of the replication from the files `benchmarks/replicate.sh` writes.

    python benchmarks/plot_heads.py [RESULTS_DIR [LR]]   (default benchmarks/results/replication; LR from
                                                         RESULTS_DIR/lr-picked.txt)

Reads every compare table in RESULTS_DIR (one per MLflow store, written by `replicate.sh compare`), pairs
runs of the same seed at the chosen lr with the baseline across stores (compare's own rule, applied over all
stores), and, for throughput, the MLflow stores next to them (read with sqlite3 only, no MLflow needed). Writes RESULTS_DIR/results.md (the tables)
and RESULTS_DIR/heads.png (tail-mean validation loss against H, one marker per seed, the baseline as a
horizontal line; right panel: the paired delta against the baseline of the same seed).

Throughput: `compare` reports the last `train/tokens_per_s` value, one window of 20 steps (381-400). The
table also gives the median over all windows of a run except the first (warm-up) and the three that hold
a validation pass (logged after steps 120, 220, 320).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sqlite3
import statistics
import sys

LABELS = [
    (r"^StandardResidual$", "baseline (standard residual)"),
    (r"^HyperConnections\(streams=4, dynamic=True", "hyper-connections (n=4, dynamic)"),
    (r"^FullAttnRes\(heads=1\)$", "single-head AttnRes (H=1)"),
    (r"^FullAttnRes\(heads=8\)$", "MHAR (H=8)"),
]


SPEED_EVERY = 20  # speed.every_n_steps of configs/replication/base.yaml


def label(method: str) -> str:
    for pattern, name in LABELS:
        if re.search(pattern, method):
            return name
    return method


def heads_of(method: str):
    m = re.match(r"^FullAttnRes\(heads=(\d+)\)$", method)
    return int(m.group(1)) if m else None


def load(path: str):
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def speed_history(db: str) -> dict[str, float]:
    """run_id -> median tokens/s over the clean windows (see the module docstring)."""
    if not os.path.isfile(db):
        return {}
    con = sqlite3.connect(db)
    rows = con.execute("select run_uuid, step, value from metrics where key = 'train/tokens_per_s'").fetchall()
    con.close()
    steps: dict[str, list[tuple[int, float]]] = {}
    for run, step, value in rows:
        steps.setdefault(run, []).append((step, value))
    per_run: dict[str, list[float]] = {}
    for run, points in steps.items():
        # Stores written before the SpeedMonitor fix of 2026-12-02 log at MLflow step = global_step - 1, and
        # Lightning re-emitted the callback's last value at every log_every_n_steps (10) flush, so each window
        # shows up twice (steps 19 and 29, 39 and 49, ...); later stores log each window once, at its
        # global step (20, 40, ...). Keep the steps where the callback measured (every 20).
        offset = 0 if all(step % SPEED_EVERY == 0 for step, _ in points) else 1
        for step, value in points:
            s = step + offset
            # skip the warm-up window and the windows right after a validation pass (121-140, ...): stores
            # written before the SpeedMonitor's second fix count the checkpoint saved at validation end there
            if s % SPEED_EVERY or s <= SPEED_EVERY or s % 100 == SPEED_EVERY:
                continue
            per_run.setdefault(run, []).append(value)
    return {run: statistics.median(v) for run, v in per_run.items() if v}


def speed_cell(r, speed) -> str:
    last, median = r["tokens_per_s"] / 1e3, speed.get(r["run_id"], math.nan) / 1e3
    k = lambda x: "n/a" if math.isnan(x) else f"{x:.0f}k"
    return f"s{r['seed']}: {k(last)} / {k(median)}"


def fmt(x, spec=".4f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def mean_std(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan, 0
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan), len(values)


def read_lr(results: str, default: str | None) -> float | None:
    path = os.path.join(results, "lr-picked.txt")
    if default:
        return float(default)
    if os.path.isfile(path):
        return float(open(path).read().strip().split("=")[-1])
    return None


def main(results: str, lr_arg: str | None = None) -> int:
    out = []
    # run name -> how many runs were on the GPU at the same time (written by hand from the device log), if present
    shared = {}
    if os.path.isfile(os.path.join(results, "shared.json")):
        shared = load(os.path.join(results, "shared.json"))
    rows, speed_rows = [], []
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        data = load(path)
        if not isinstance(data, dict) or "rows" not in data:
            continue
        store = os.path.basename(path)[:-5]
        if store == "pooled":  # compare over all stores at once: the same runs again
            continue
        for r in data["rows"]:
            r["store"] = store
            (speed_rows if store == "speed" else rows).append(r)
    speed = {}
    for db in glob.glob(os.path.join(results, "mlflow-*.db")):
        speed.update(speed_history(db))
    lr = read_lr(results, lr_arg)

    # ------------------------------------------------------------------ lr tune
    lr_rows = [r for r in rows if r["store"].startswith("lr-") and r["method"] == "StandardResidual" and r["seed"] == "1"]
    if lr_rows:
        out += ["## Learning-rate tune (baseline, seed 1)", "",
                "| lr | final val loss | tail-mean | status | store |", "|---|---|---|---|---|"]
        for r in sorted(lr_rows, key=lambda r: float(r["lr"])):
            out.append(f"| {r['lr']} | {fmt(r['final'])} | {fmt(r['tail_mean'])} | {r['status']} | {r['store']} |")
        out += ["", f"Chosen lr (lowest tail-mean): {lr}", ""]

    main_rows = [r for r in rows if lr is not None and float(r["lr"]) == lr]
    base = {}  # seed -> baseline row at the chosen lr
    for r in main_rows:
        if r["method"] == "StandardResidual":
            if r["seed"] in base:
                print(f"warning: two baselines for seed {r['seed']}; using the first", file=sys.stderr)
                continue
            base[r["seed"]] = r
    for r in main_rows:
        b = base.get(r["seed"])
        r["pdelta"] = r["tail_mean"] - b["tail_mean"] if b else math.nan
    speed_by_method = {r["method"]: r for r in speed_rows}

    # ------------------------------------------------------------------ methods
    order = [name for _, name in LABELS]
    by_method: dict[str, list] = {}
    for r in main_rows:
        if label(r["method"]) in order:
            by_method.setdefault(r["method"], []).append(r)
    if by_method:
        out += ["## Methods", "",
                "tail-mean = mean of the validation losses at steps 200, 300, 400; paired delta = run minus the "
                "baseline of the same seed (tail-mean); tokens/s: the speed callback's last 20-step window (what "
                "`compare` shows) / the median of its 20-step windows after step 20 without the three that hold a "
                "validation pass; 'alone' = the `speed` runs (80 steps, one run on the GPU), 'GPU shared by k' = the "
                "400-step run itself while k runs shared the GPU (k = 1: it ran alone; still one short window, with "
                "the data preparation of its process on the CPU beside it).", "",
                "| method | seeds | tail-mean per seed | mean tail-mean | paired delta (mean ± std) | deltas per seed "
                "| tokens/s (last window / median) |",
                "|---|---|---|---|---|---|---|"]
        for method in sorted(by_method, key=lambda m: order.index(label(m))):
            mine = sorted(by_method[method], key=lambda r: r["seed"])
            dm, ds, n = mean_std([r["pdelta"] for r in mine])
            tm, _, _ = mean_std([r["tail_mean"] for r in mine])
            sp = speed_by_method.get(method)
            if sp:
                sp_cell = "alone: " + speed_cell(sp, speed).split(": ", 1)[1]
            else:  # no solo speed run: the 400-step runs' own numbers, measured beside other runs
                sp_cell = " ; ".join(f"GPU shared by {shared.get(r['name'], '?')}: " +
                                     speed_cell(r, speed).split(": ", 1)[1] for r in mine)
            out.append(
                f"| {label(method)} | {','.join(r['seed'] for r in mine)} | "
                f"{' / '.join(fmt(r['tail_mean']) for r in mine)} | {fmt(tm)} | "
                f"{fmt(dm, '+.4f')} ± {fmt(ds)} (n={n}) | {' / '.join(fmt(r['pdelta'], '+.4f') for r in mine)} | "
                f"{sp_cell} |")
        out.append("")
        seeds = sorted(base)
        if len(seeds) > 1:
            b = [base[s]["tail_mean"] for s in seeds]
            out += [f"Baseline tail-mean across seeds: {' / '.join(fmt(x) for x in b)} (spread {fmt(max(b) - min(b))}).", ""]

    # ------------------------------------------------------------------ H sweep
    points = []  # (H, seed, tail, delta, tokens_s_last, tokens_s_median, store, runs sharing the GPU)
    for r in main_rows:
        h = heads_of(r["method"])
        if h is not None:
            points.append((h, r["seed"], r["tail_mean"], r["pdelta"], r["tokens_per_s"], speed.get(r["run_id"], math.nan),
                           r["store"], shared.get(r["name"], "?")))
    if points:
        out += ["## H sweep (MHAR, FullAttnRes)", "",
                "tokens/s: the 400-step run itself (last window / median, as in the methods table); 'shared by k': "
                "k runs shared the GPU (k = 1: it ran alone, a speed measurement; k > 1: not one).", "",
                "| H | seed | tail-mean | delta vs baseline (same seed) | tokens/s (last / median) | GPU shared by | store |",
                "|---|---|---|---|---|---|---|"]
        for p in sorted(points, key=lambda p: (p[0], p[1])):
            cell = speed_cell({"seed": p[1], "tokens_per_s": p[4], "run_id": None}, {None: p[5]}).split(": ", 1)[1]
            out.append(f"| {p[0]} | {p[1]} | {fmt(p[2])} | {fmt(p[3], '+.4f')} | {cell} | {p[7]} | {p[6]} |")
        out.append("")
        out += ["| H | seeds | mean delta vs baseline | std |", "|---|---|---|---|"]
        for h in sorted({p[0] for p in points}):
            dm, ds, n = mean_std([p[3] for p in points if p[0] == h])
            out.append(f"| {h} | {n} | {fmt(dm, '+.4f')} | {fmt(ds)} |")
        out.append("")
        plot(points, base, os.path.join(results, "heads.png"))

    text = "\n".join(out)
    with open(os.path.join(results, "results.md"), "w") as fh:
        fh.write("# Replication results (generated by benchmarks/plot_heads.py)\n\n" + text + "\n")
    print(text)
    return 0


def plot(points, base, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({p[1] for p in points})
    colors = {s: c for s, c in zip(seeds, ["tab:blue", "tab:orange", "tab:green", "tab:red"])}
    markers = {s: m for s, m in zip(seeds, ["o", "s", "^", "D"])}
    hs = sorted({p[0] for p in points})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for s in seeds:
        mine = sorted([p for p in points if p[1] == s])
        ax.plot([p[0] for p in mine], [p[2] for p in mine], marker=markers[s], color=colors[s], ls="-", lw=0.8,
                label=f"MHAR, seed {s}")
        if s in base:
            ax.axhline(base[s]["tail_mean"], color=colors[s], ls="--", lw=1, label=f"baseline, seed {s}")
        ax2.plot([p[0] for p in mine], [p[3] for p in mine], marker=markers[s], color=colors[s], ls="-", lw=0.8,
                 label=f"seed {s}")
    means = [statistics.fmean([p[3] for p in points if p[0] == h and not math.isnan(p[3])] or [math.nan]) for h in hs]
    ax2.plot(hs, means, color="black", lw=1.5, label="mean over seeds")
    ax2.axhline(0.0, color="gray", ls="--", lw=1, label="baseline (same seed)")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(hs, [str(h) for h in hs])
        a.set_xlabel("routing heads H")
        a.grid(alpha=0.3)
    ax.set_ylabel("tail-mean val loss (steps 200-400)")
    ax.set_title(f"MHAR vs H (d 512, L 12, 400 steps, 6.6M tokens); H run: {', '.join(map(str, hs))}", fontsize=9)
    ax2.set_ylabel("paired delta vs baseline")
    ax2.set_title("paired delta (run - baseline of the same seed)", fontsize=9)
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="benchmarks/results/replication")
    parser.add_argument("lr", nargs="?", default=None)
    cli = parser.parse_args()
    sys.exit(main(cli.results, cli.lr))
