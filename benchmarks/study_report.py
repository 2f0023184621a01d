"""The routing study's report (docs/study.md) from the exports that `benchmarks/study.py piece` writes.

    python benchmarks/study_report.py [EXPORTS...] [--out benchmarks/results/study]

EXPORTS are study-SET.json files or folders of them (default benchmarks/results/study/exports/). Writes to --out:
summary.json (`arms`: {name: {"steps", "seeds", "tail_mean", "delta_vs_baseline", "delta_vs_H1", ...}}, per run
detail and the commit), table.md (the table of docs/replication.md), loss.png (validation loss per run and its
paired difference to the baseline per arm) and entropy.png (per-token routing entropy / log N, 1 = uniform).

Tail-means are over the last `tail_k` scheduled validations at or before a step: an arm's `steps` is the fewest
any of its seeds reached (all of them when every run finished), and a paired delta compares two runs of the same
seed at the fewer steps of the two (`delta_steps`), so that a run cut short by its budget is never compared with
a longer one. Runs trained on different corpora or base configs are refused: their losses are not comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DEFAULT_EXPORTS = REPO / "benchmarks/results/study/exports"
DEFAULT_OUT = REPO / "benchmarks/results/study"
REFERENCES = ("baseline", "H1")
# docs/method.md H.1: peak 5e-4, 1,000 warmup steps, cosine to 10% at step 20,000
PAPER_SCHEDULE = {"lr": 5e-4, "warmup_steps": 1000, "decay_steps": 20000, "min_lr_ratio": 0.1, "max_steps": 20000}


# ---------------------------------------------------------------------------------------------- reading
def export_files(inputs: list[Path]) -> list[Path]:
    files = []
    for path in inputs:
        files += sorted(path.glob("study-*.json")) if path.is_dir() else [path]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise SystemExit(f"no study exports at {', '.join(missing or map(str, inputs))} (write them with "
                         "`benchmarks/study.py piece`)")
    return files


def load_runs(files: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every exported run (the furthest export of each arm and seed wins: a set's second piece holds its first) and
    the schedule; one line for runs that cannot be compared."""
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    schedules = []
    for path in files:
        export = json.loads(path.read_text())
        schedules.append(export["schedule"])
        for run in export["runs"]:
            run = {**run, "commit": export["piece"].get("commit"), "export": path.name}
            key = (run["arm"], run["seed"])
            if key not in runs or run["step"] >= runs[key]["step"]:
                runs[key] = run
    for field in ("corpus_sha256", "base_sha256"):
        values = {r["identity"][field] for r in runs.values()}
        if len(values) > 1:
            raise SystemExit(f"the exports mix runs of {len(values)} different {field.removesuffix('_sha256')}s "
                             f"({', '.join(sorted(v[:12] for v in values))}): their losses are not comparable")
    if any(s != schedules[0] for s in schedules):
        raise SystemExit("the exports mix schedules: their losses are not comparable")
    from benchmarks.study import ARMS

    order = {arm: i for i, arm in enumerate(ARMS)}  # baseline, H1, H8, then the study's arms
    return sorted(runs.values(), key=lambda r: (order.get(r["arm"], len(order)), r["arm"], r["seed"])), schedules[0]


# ---------------------------------------------------------------------------------------------- numbers
def tail_mean(val: list[list[float]], until: int, k: int) -> Optional[float]:
    """Mean of the last k scheduled validations at or before step `until` (None without any)."""
    values = [v for s, v in val if s <= until][-k:]
    return sum(values) / len(values) if values else None


def last_at(history: list[list[float]], until: int) -> Optional[float]:
    values = [v for s, v in history if s <= until]
    return values[-1] if values else None


def spread(values: list[Optional[float]]) -> Optional[dict[str, Any]]:
    """Mean, sample std, min and max over the values present (None without any)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    n, mean = len(present), sum(present) / len(present)
    std = (sum((v - mean) ** 2 for v in present) / (n - 1)) ** 0.5 if n > 1 else None
    return {"mean": mean, "std": std, "min": min(present), "max": max(present), "n": n}


def summed_lr(schedule: dict[str, Any], steps: int) -> float:
    """The lr summed over the first `steps` optimizer steps of a schedule (the module's own lr_factor)."""
    from mhar_lit.lit.module import lr_factor

    return schedule["lr"] * sum(lr_factor(t, schedule["warmup_steps"], schedule["decay_steps"],
                                          schedule["min_lr_ratio"]) for t in range(steps))


def _paired_delta(run: dict[str, Any], reference: Optional[dict[str, Any]], k: int) -> tuple[Optional[float], int]:
    if reference is None:
        return None, 0
    step = min(run["step"], reference["step"])
    mine, theirs = tail_mean(run["val"], step, k), tail_mean(reference["val"], step, k)
    return (None if mine is None or theirs is None else mine - theirs), step


def summarise(runs: list[dict[str, Any]], schedule: dict[str, Any]) -> dict[str, Any]:
    """summary.json: per arm (seeds in order), per run, the summed lr of the paper and of the study's schedule."""
    k, every = runs[0]["tail_k"], runs[0]["validation_every"]
    by_key = {(r["arm"], r["seed"]): r for r in runs}
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        steps = min(r["step"] for r in mine)
        entry: dict[str, Any] = {"steps": steps, "seeds": [r["seed"] for r in mine],
                                 "tail_mean": [tail_mean(r["val"], steps, k) for r in mine]}
        for ref in REFERENCES:
            pairs = [_paired_delta(r, by_key.get((ref, r["seed"])), k) for r in mine]
            entry[f"delta_vs_{ref}"] = [d for d, _ in pairs]
            entry[f"delta_vs_{ref}_steps"] = [s for _, s in pairs]
        entry["entropy"] = [last_at(r["metrics"]["entropy"], steps) for r in mine]
        entry["lr_sum"] = [last_at(r["metrics"]["lr_sum"], steps) for r in mine]
        entry["routing_lr_sum"] = [last_at(r["metrics"]["routing_lr_sum"], steps) or lr
                                   for r, lr in zip(mine, entry["lr_sum"])]
        entry["tail_mean_spread"] = spread(entry["tail_mean"])
        arms[arm] = entry
    commits = sorted({str(r["commit"]) for r in runs})
    return {
        "commit": commits[0] if len(commits) == 1 else commits,
        "validation_every": every, "tail_k": k, "schedule": schedule,
        "lr_sum_planned": summed_lr(schedule, schedule["max_steps"]),
        "lr_sum_paper": summed_lr(PAPER_SCHEDULE, PAPER_SCHEDULE["max_steps"]),
        "arms": arms,
        "runs": {f"{r['arm']}-s{r['seed']}": {"step": r["step"], "pieces": r["pieces"], "commit": r["commit"],
                                              "export": r["export"], "precision": r["identity"]["precision"]}
                 for r in runs},
    }


# ---------------------------------------------------------------------------------------------- table
def _fmt(value: Optional[float], digits: int = 4, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _per_seed(values: list[Optional[float]], digits: int = 4, signed: bool = False) -> str:
    text = " / ".join(_fmt(v, digits, signed) for v in values)
    summary = spread(values)
    if summary and summary["n"] > 1:
        text += f" (mean {_fmt(summary['mean'], digits, signed)})"
    return text


def table_markdown(summary: dict[str, Any]) -> str:
    """The study's table: tail-mean per seed, paired deltas against baseline and H1, seed spread, entropy, lr sums."""
    rows = ["| arm | steps | seeds | tail-mean per seed | delta vs baseline | delta vs H1 | seed spread (max - min) "
            "| routing entropy / log N | summed lr (routing) |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, e in summary["arms"].items():
        tail = e["tail_mean_spread"]
        seed_range = _fmt(tail["max"] - tail["min"]) if tail and tail["n"] > 1 else "-"
        lr = spread(e["lr_sum"])
        routing = spread(e["routing_lr_sum"])
        lr_text = "-" if lr is None else f"{lr['mean']:.2f} ({routing['mean']:.2f})"
        rows.append(f"| {arm} | {e['steps']} | {', '.join(map(str, e['seeds']))} | {_per_seed(e['tail_mean'])} "
                    f"| {_per_seed(e['delta_vs_baseline'], signed=True)} | {_per_seed(e['delta_vs_H1'], signed=True)} "
                    f"| {seed_range} | {_per_seed(e['entropy'], 2)} | {lr_text} |")
    rows.append("")
    rows.append(f"Tail-mean: the last {summary['tail_k']} validations (every {summary['validation_every']} steps) "
                f"at or before the arm's steps; paired deltas at the fewer steps of the pair. Summed lr of the "
                f"study's schedule at its end: {summary['lr_sum_planned']:.2f}; of the paper's (20K steps at 5e-4): "
                f"{summary['lr_sum_paper']:.2f}. Commit: {summary['commit']}.")
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------- plots
def _colours(runs: list[dict[str, Any]]) -> dict[str, str]:
    return {arm: f"C{i % 10}" for i, arm in enumerate(dict.fromkeys(r["arm"] for r in runs))}


def _style(seed: int, seeds: list[int]) -> str:
    return ("-", "--", ":", "-.")[seeds.index(seed) % 4]


def plot_curves(runs: list[dict[str, Any]], key: str, ylabel: str, out: Path,
                reference: Optional[str] = "baseline") -> None:
    """One line per run (colour: arm, line style: seed); with `reference`, a second panel of each arm's paired
    difference to that arm at the steps both have, averaged over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {(r["arm"], r["seed"]): dict(map(tuple, r["val"] if key == "val" else r["metrics"][key])) for r in runs}
    series = {k: v for k, v in series.items() if v}
    refs = {s: series[(reference, s)] for _, s in series if (reference, s) in series} if reference else {}
    panels = 2 if refs else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), layout="constrained", squeeze=False)
    colours, seeds = _colours(runs), sorted({s for _, s in series})
    for (arm, seed), values in series.items():
        axes[0][0].plot(list(values), list(values.values()), color=colours[arm], linestyle=_style(seed, seeds),
                        label=f"{arm} s{seed}")
    if refs:
        for arm in dict.fromkeys(a for a, _ in series):
            diffs: dict[int, list[float]] = {}
            for (a, seed), values in series.items():
                if a == arm and seed in refs:
                    for step in sorted(values.keys() & refs[seed].keys()):
                        diffs.setdefault(step, []).append(values[step] - refs[seed][step])
            if diffs and arm != reference:
                axes[0][1].plot(list(diffs), [sum(d) / len(d) for d in diffs.values()], color=colours[arm], label=arm)
        axes[0][1].axhline(0.0, color="k", linewidth=0.8)
        axes[0][1].set_ylabel(f"{ylabel} minus {reference}'s (same seed, mean over seeds)")
    axes[0][0].set_ylabel(ylabel)
    for ax in axes[0]:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def write_report(inputs: list[Path], out: Path, suffix: str = "") -> dict[str, Any]:
    runs, schedule = load_runs(export_files(inputs))
    summary = summarise(runs, schedule)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"summary{suffix}.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    (out / f"table{suffix}.md").write_text(table_markdown(summary))
    plot_curves(runs, "val", "validation loss", out / f"loss{suffix}.png")
    plot_curves(runs, "entropy", "per-token routing entropy / log N (1 = uniform)", out / f"entropy{suffix}.png",
                reference=None)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exports", nargs="*", type=Path, default=[DEFAULT_EXPORTS])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    summary = write_report(args.exports, args.out)
    print(table_markdown(summary), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
