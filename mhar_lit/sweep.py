"""Sweeps and paired comparisons over MLflow runs.

    python -m mhar_lit sweep --config configs/replication/base.yaml \\
        --grid config=configs/methods/baseline.yaml,configs/methods/mhar.yaml \\
        --grid model.lr=1e-3,5e-4 --grid seed_everything=1,2 [-- extra fit args]

runs the cross product of the grid as separate `fit` processes (one MLflow run each, tagged with one
sweep id; `config=` values are extra config files layered on the base, other keys are CLI overrides), and

    python -m mhar_lit compare --sweep ID

prints final and tail-mean validation loss per run with the paired delta against the standard-residual
run of the same seed (and learning rate), then the per-method mean and spread of those deltas. A resumed run
(tag `resumed_from_run`) is the continuation of its parent: one row, one seed. Only finished runs are paired
and averaged; a killed or failed one is shown with its state and step. RUNNING runs whose process is gone are
marked KILLED first (mhar_lit.tracking.reap_dead_runs). Two finished runs of one method, seed and settings are
refused.

Flags follow jsonargparse's spelling (`--sweep_id`, `--dry_run`, `--keep_going`, `--tracking_uri`); the
hyphenated forms are accepted too.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
from typing import Any, Optional

from mhar_lit.command_line import command_parser
from mhar_lit.errors import UserError, exits_on_user_error
from mhar_lit.tracking import (DEFAULT_EXPERIMENT, DEFAULT_TRACKING_URI, check_store_schema,
                               is_standard_residual_run, local_store_path, reap_dead_runs, redact_credentials)


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    grid = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise UserError(f"--grid expects key=v1,v2,..., got {spec!r}")
        grid.append((key.strip(), [v.strip() for v in values.split(",") if v.strip()]))
    return grid


def grid_points(grid: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    keys = [k for k, _ in grid]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(values for _, values in grid))]


def fit_command(configs: list[str], point: dict[str, str], sweep_id: str, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "mhar_lit", "fit"]
    for config in configs:
        cmd += ["--config", config]
    for key, value in point.items():
        cmd += ["--config", value] if key == "config" else [f"--{key}", value]
    # Not JSON: jsonargparse would parse a JSON-looking tag value into a dict, which MLflow rejects.
    tags = {"sweep_id": sweep_id, "sweep_point": point_tag(point)}
    run_name = f"{point_label(point)} ({sweep_id})"
    cmd += ["--trainer.logger.init_args.tags", json.dumps(tags), "--trainer.logger.init_args.run_name", run_name]
    return cmd + extra


SWEEP_HELP = """Runs the cross product of the grid as separate `fit` processes, one MLflow run each, tagged with one
sweep id. `config=` values are extra config files layered on the base; other keys are fit flags.

    python -m mhar_lit sweep --config configs/replication/base.yaml \\
        --grid config=configs/methods/baseline.yaml,configs/methods/mhar.yaml \\
        --grid model.lr=1e-3,5e-4 --grid seed_everything=1,2 [-- extra fit args]

Arguments after `--` go to every `fit` run. Then: python -m mhar_lit compare --sweep ID
After an interruption, the same command with --sweep_id ID --resume continues the sweep: finished points are
skipped, killed ones resume from their last.ckpt."""
COMPARE_HELP = """Final and tail-mean validation loss of a sweep's runs, the paired delta of each against the
StandardResidual run of the same seed and lr, and per method the mean and spread of those deltas."""


def build_sweep_parser():
    parser = command_parser("sweep", SWEEP_HELP, unknown_hint=FIT_ARGS_HINT)
    parser.add_argument("--config", action="append", required=True, help="base config file(s), repeatable")
    parser.add_argument("--grid", action="append", default=[], help="key=v1,v2 (repeatable)")
    parser.add_argument("--sweep_id", "--sweep-id", default=None, help="default: sw-<date>-<random>")
    parser.add_argument("--dry_run", "--dry-run", action="store_true", help="print the planned runs, run none")
    parser.add_argument("--keep_going", "--keep-going", action="store_true",
                        help="run the remaining points if one fails")
    parser.add_argument("--resume", action="store_true",
                        help="with the --sweep_id of an earlier sweep: skip the points whose run finished, continue "
                             "a killed or failed one from its last.ckpt (a new run tagged resumed_from_run), start "
                             "those without a checkpoint again")
    parser.add_argument("--tracking_uri", "--tracking-uri", default=None,
                        help="MLflow store of the runs, passed to every fit (default: the fit args', else "
                             f"{DEFAULT_TRACKING_URI})")
    return parser


TRACKING_URI_FLAG = "--trainer.logger.init_args.tracking_uri"
FIT_ARGS_HINT = ("arguments for every `fit` go after `--`: python -m mhar_lit sweep --config C --grid K=V1,V2 -- "
                 "--trainer.max_steps 30")


def sweep_tracking_uri(args: Any, extra: list[str]) -> str:
    """The store the sweep's fits log to: --tracking_uri, else the fit args' own, else the default."""
    if args.tracking_uri:
        return args.tracking_uri
    given = [extra[i + 1] for i, word in enumerate(extra[:-1]) if word == TRACKING_URI_FLAG]
    given += [word.split("=", 1)[1] for word in extra if word.startswith(TRACKING_URI_FLAG + "=")]
    return given[-1] if given else DEFAULT_TRACKING_URI


def resume_plan(tracking_uri: str, experiment: str, sweep_id: str, point: dict[str, str]) -> tuple[str, str]:
    """What `sweep --resume` does with a point: ("skip", why), ("resume", last.ckpt) or ("start", why)."""
    path = local_store_path(tracking_uri)
    if path is not None and not os.path.exists(path):
        return "start", "no store yet"
    client, exp = _open_store(tracking_uri, experiment)
    if exp is None:
        return "start", "no runs yet"
    runs = client.search_runs([exp.experiment_id], max_results=5000, filter_string=(
        f"tags.sweep_id = '{sweep_id}' and tags.sweep_point = '{point_tag(point)}'"))
    chains = chain_runs([_run_row(client, tracking_uri, run) for run in runs])
    if any(finished(c) for c in chains):
        return "skip", "finished"
    if any(c["status"] == "RUNNING" for c in chains):
        return "skip", "still running (its process is alive)"
    for chain in sorted(chains, key=lambda c: -1 if c["step"] is None else c["step"], reverse=True):
        last = os.path.join(chain["checkpoint_dir"] or "", "last.ckpt")
        if chain["checkpoint_dir"] and os.path.isfile(last):
            return "resume", last
    return "start", "no checkpoint to resume from" if chains else "no run yet"


def point_label(point: dict[str, str]) -> str:
    """What differs between a sweep's runs, first in their names (MLflow's run list cuts long names): `mhar seed=1`
    for config=configs/methods/mhar.yaml and seed_everything=1."""
    parts = []
    for key, value in point.items():
        if key == "config":
            parts.append(os.path.splitext(os.path.basename(value))[0])
        else:
            parts.append(f"{'seed' if key == 'seed_everything' else key.split('.')[-1]}={value.split('/')[-1]}")
    return " ".join(parts) or "run"


def point_tag(point: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(point.items()))


def check_point(cmd: list[str], label: str) -> dict[str, Any]:
    """Parse one point's `fit` arguments with the real LightningCLI parser, in this process, without training:
    a grid value naming a missing config or a key `fit` does not have fails the sweep before its first fit.
    Returns the resolved settings."""
    import contextlib
    import io

    import yaml

    from mhar_lit.cli import build_cli

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when given args beside a command line of its own
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            build_cli(cmd[4:] + ["--print_config"], run=False)
    except SystemExit as done:
        if done.code not in (0, None):
            reason = err.getvalue().strip().splitlines()[-1:] or ["invalid arguments"]
            raise UserError(f"grid point {label}: {reason[0].removeprefix('error: ')}") from None
    finally:
        sys.argv = argv
    return yaml.safe_load(out.getvalue()) or {}


def no_validation_reason(settings: dict[str, Any]) -> Optional[str]:
    """Why a fit with these settings never validates (so `compare` has no final or tail value), or None."""
    trainer, data = settings.get("trainer") or {}, settings.get("data") or {}
    if trainer.get("limit_val_batches") in (0, 0.0):
        return "trainer.limit_val_batches is 0"
    if data.get("val_fraction") in (0, 0.0):
        return "data.val_fraction is 0 (no held-out documents)"
    every, steps = trainer.get("val_check_interval"), trainer.get("max_steps")
    if (isinstance(every, int) and not isinstance(every, bool) and trainer.get("check_val_every_n_epoch") is None
            and isinstance(steps, int) and 0 < steps < every):
        return f"trainer.val_check_interval {every} > trainer.max_steps {steps}"
    return None


def check_points(commands: list[tuple[str, list[str]]]) -> None:
    """Every point parsed before the first fit (check_point); a warning for points that will never validate."""
    for label, cmd in commands:
        reason = no_validation_reason(check_point(cmd, label))
        if reason:
            print(f"sweep: warning: {label} will never validate ({reason}): compare will show its final, tail and "
                  "delta as -", file=sys.stderr, flush=True)


@exits_on_user_error()
def sweep_main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_sweep_parser().parse_args(argv)
    if args.resume and not args.sweep_id:
        raise UserError("--resume needs the --sweep_id of the sweep to continue")
    if args.tracking_uri:
        extra = [TRACKING_URI_FLAG, args.tracking_uri, *extra]
    points = grid_points(parse_grid(args.grid))
    sweep_id = args.sweep_id or f"sw-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    print(f"sweep {sweep_id}: {len(points)} runs{' planned (dry run)' if args.dry_run else ''}", flush=True)
    check_points([(point_label(p), fit_command(args.config, p, sweep_id, extra)) for p in points])
    failures = 0
    for index, point in enumerate(points, 1):
        cmd = fit_command(args.config, point, sweep_id, extra)
        if args.resume:
            action, detail = resume_plan(sweep_tracking_uri(args, extra), DEFAULT_EXPERIMENT, sweep_id, point)
            print(f"[{index}/{len(points)}] {point_tag(point)}: {action} ({detail})", flush=True)
            if action == "skip":
                continue
            if action == "resume":
                cmd += ["--ckpt_path", detail]
        print(f"[{index}/{len(points)}] {redact_credentials(' '.join(cmd[1:]))}", flush=True)
        if args.dry_run:
            continue
        code = subprocess.call(cmd)
        if code != 0:
            failures += 1
            print(f"run {index} failed with exit code {code}", file=sys.stderr)
            if not args.keep_going:
                return code
    if args.dry_run:
        print(f"dry run: planned {len(points)} runs, ran none")
        return 0
    print(f"done: {len(points) - failures}/{len(points)} runs succeeded; compare with:\n"
          f"  python -m mhar_lit compare --sweep {sweep_id}")
    return 1 if failures else 0


# ----------------------------------------------------------------------------- compare
def collect_runs(sweep_id: str, tracking_uris: str | list[str], experiment: str) -> list[dict[str, Any]]:
    """The sweep's runs from one or several MLflow stores (runs made side by side need one sqlite store each)."""
    uris = [tracking_uris] if isinstance(tracking_uris, str) else list(tracking_uris)
    rows = [row for uri in uris for row in _store_runs(sweep_id, uri, experiment)]
    if not rows:
        raise UserError(f"no runs tagged sweep_id={sweep_id!r} in experiment {experiment!r} at "
                         f"{', '.join(uris)}")
    return rows


def require_existing_store(tracking_uri: str) -> None:
    """Reading commands must not create a store: MLflow makes an empty one (and its folders) at a mistyped path."""
    path = local_store_path(tracking_uri)
    if path is not None and not os.path.exists(path):
        raise UserError(f"no MLflow store at {path} (tracking URI {tracking_uri})")


def _store_runs(sweep_id: str, tracking_uri: str, experiment: str) -> list[dict[str, Any]]:
    client, exp = _open_store(tracking_uri, experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.sweep_id = '{sweep_id}'", max_results=5000)
    return [_run_row(client, tracking_uri, run) for run in runs]


def _open_store(tracking_uri: str, experiment: str):
    """The store's client and experiment (None if absent), after marking its dead RUNNING runs KILLED."""
    from mlflow.tracking import MlflowClient

    require_existing_store(tracking_uri)
    if tracking_uri.startswith("sqlite:///"):
        check_store_schema(local_store_path(tracking_uri), tracking_uri)
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        reap_dead_runs(client, [exp.experiment_id])
    return client, exp


def _run_row(client: Any, tracking_uri: str, run: Any) -> dict[str, Any]:
    tags, metrics = run.data.tags, run.data.metrics
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")]
    return {
        "run_id": run.info.run_id,
        "store": tracking_uri,
        "name": tags.get("mlflow.runName", run.info.run_id[:8]),
        "status": run.info.status,
        "start_time": run.info.start_time or 0,
        "resumed_from": tags.get("resumed_from_run"),
        "checkpoint_dir": tags.get("checkpoint_dir"),
        "method": tags.get("method", "?"),
        "baseline": is_standard_residual_run(tags),
        "seed": tags.get("seed", "?"),
        "lr": run.data.params.get("lr", "?"),
        "settings": dict(run.data.params),
        "history": sorted(history),
        "tail_mean": metrics.get("val/tail_mean", math.nan),
        "tokens_per_s": metrics.get("train/tokens_per_s", math.nan),
    }


# ----------------------------------------------------------------------------- resumed runs are one seed
def chain_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join each resumed run to the run it continues (its `resumed_from_run` tag, same store): a chain is one
    seed. Its validation history is the concatenation (a link's values from the step its successor resumed at
    on are replaced by the successor's), its final loss the last value of that history; its tail-mean,
    throughput and state are those of its last link that has them. A run resumed twice from one parent gives
    two chains (which `check_duplicates` then refuses if both finished)."""
    by_id = {(r["store"], r["run_id"]): r for r in rows}
    children: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        parent = (r["store"], r["resumed_from"])
        if r["resumed_from"] and parent in by_id:
            children.setdefault(parent, []).append(r)
    roots = [r for r in rows if not (r["resumed_from"] and (r["store"], r["resumed_from"]) in by_id)]
    chains = []

    def walk(path: list[dict[str, Any]]) -> None:
        nxt = sorted(children.get((path[-1]["store"], path[-1]["run_id"]), []), key=lambda r: r["start_time"])
        if not nxt:
            chains.append(_chain_row(path))
        for child in nxt:
            walk(path + [child])

    for root in roots:
        walk([root])
    return chains


def _chain_row(links: list[dict[str, Any]]) -> dict[str, Any]:
    history: list[tuple[int, float]] = []
    for link in links:
        if link["history"]:
            first = link["history"][0][0]
            history = [h for h in history if h[0] < first] + link["history"]

    def latest(key: str) -> float:
        return next((r[key] for r in reversed(links) if not math.isnan(r[key])), math.nan)

    last = links[-1]
    name = last["name"] + (f" (+{len(links) - 1} resumed)" if len(links) > 1 else "")
    kept = ("method", "baseline", "seed", "lr", "settings", "status", "store", "checkpoint_dir")
    return {**{k: last[k] for k in kept},
            "name": name, "runs": [r["run_id"] for r in links],
            "step": history[-1][0] if history else None,
            "final": history[-1][1] if history else math.nan,
            "tail_mean": latest("tail_mean"), "tokens_per_s": latest("tokens_per_s")}


def finished(row: dict[str, Any]) -> bool:
    """A row without a status (built by hand, not read from a store) counts as finished."""
    return row.get("status", "FINISHED") == "FINISHED"


def check_duplicates(chains: list[dict[str, Any]]) -> None:
    """Two finished chains of one method, seed and settings (all params) would be pooled as two seeds."""
    seen: dict[tuple, dict[str, Any]] = {}
    for c in filter(finished, chains):
        key = (c["method"], c["seed"], tuple(sorted(c["settings"].items())))
        if key in seen:
            raise UserError(f"two finished runs of {c['method']} at seed {c['seed']} with the same "
                             f"settings: {seen[key]['name']!r} and {c['name']!r} (a run started again instead of "
                             "resumed, or a sweep run twice); delete one of them or give them different seeds")
        seen[key] = c


def is_baseline(row: dict[str, Any]) -> bool:
    """A row of the standard residual (read from its run's tags; a row built by hand says so by its label)."""
    return row["baseline"] if "baseline" in row else is_standard_residual_run({"method": row["method"]})


def add_paired_deltas(rows: list[dict[str, Any]], metric: str) -> None:
    """Paired means same seed AND same learning rate, both runs finished; any other row gets no delta (NaN)."""
    baselines: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if not is_baseline(r) or not finished(r):
            continue
        key = (r["seed"], r["lr"])
        if key in baselines:  # pairing against an arbitrary one of them would be silently wrong
            raise UserError(f"two baseline runs at seed {key[0]} and lr {key[1]}: "
                             f"{baselines[key].get('name')!r} and {r.get('name')!r}; give the sweep one baseline "
                             "per (seed, lr), or delete one of them")
        baselines[key] = r
    for row in rows:
        base = baselines.get((row["seed"], row["lr"]))
        row["delta"] = row[metric] - base[metric] if base and finished(row) else math.nan


def summarize(rows: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Per method over its finished runs only: the mean metric and the mean and spread of its paired deltas."""
    summary = []
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method and finished(r)]
        deltas = [r["delta"] for r in mine if not math.isnan(r["delta"])]
        values = [r[metric] for r in mine if not math.isnan(r[metric])]
        summary.append({
            "method": method, "runs": len(mine),
            "mean": statistics.fmean(values) if values else math.nan,
            "delta_mean": statistics.fmean(deltas) if deltas else math.nan,
            "delta_std": statistics.stdev(deltas) if len(deltas) > 1 else math.nan,
            "paired": len(deltas),
            "unfinished": sum(1 for r in rows if r["method"] == method and not finished(r)),
        })
    return summary


def _number(value: float, spec: str, width: int) -> str:
    """A table cell: `-` for a missing value (NaN: no baseline to pair with, fewer than two deltas)."""
    sign, precision = ("+", spec[1:]) if spec.startswith("+") else ("", spec)
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{sign}{width}{precision}}"


def _spread(summary_row: dict[str, Any]) -> str:
    if not math.isnan(summary_row["delta_std"]):
        return f"{summary_row['delta_std']:>8.4f}"
    return f"{'-':>8}" + (f"  ({summary_row['paired']} seed)" if summary_row["paired"] == 1 else "")


def state(row: dict[str, Any]) -> str:
    """`done`, or the run's MLflow status and the step of its last validation (KILLED@49, RUNNING@-)."""
    return "done" if finished(row) else f"{row['status']}@{'-' if row['step'] is None else row['step']}"


def format_table(rows: list[dict[str, Any]], summary: list[dict[str, Any]], metric: str) -> str:
    width = max([len("method")] + [len(r["method"]) for r in rows])
    swidth = max([len("state")] + [len(state(r)) for r in rows])
    lines = [f"{'method':<{width}} {'seed':>5} {'lr':>8} {'state':<{swidth}} {'final':>8} {'tail':>8} {'delta':>8} "
             f"{'tok/s':>9}  run"]
    for r in sorted(rows, key=lambda r: (r["method"], str(r["seed"]), str(r["lr"]), not finished(r))):
        lines.append(f"{r['method']:<{width}} {r['seed']:>5} {r['lr']:>8} {state(r):<{swidth}} "
                     f"{_number(r['final'], '.4f', 8)} {_number(r['tail_mean'], '.4f', 8)} "
                     f"{_number(r['delta'], '+.4f', 8)} {_number(r['tokens_per_s'], '.0f', 9)}  {r['name']}")
    lines.append("")
    lines.append(f"{'method':<{width}} {'runs':>5} {'mean ' + metric:>18} {'paired delta':>13} {'+- std':>8}")
    for s in summary:
        lines.append(f"{s['method']:<{width}} {s['runs']:>5} {_number(s['mean'], '.4f', 18)} "
                     f"{_number(s['delta_mean'], '+.4f', 13)} {_spread(s)}")
    empty = [r for r in rows if math.isnan(r["final"])]
    if empty:
        lines += ["", f"{len(empty)} run(s) logged no validation loss, so their final, tail and delta are -: "
                      "trainer.val_check_interval larger than trainer.max_steps, no held-out data, or killed before "
                      "the first validation"]
    unfinished = sum(s["unfinished"] for s in summary)
    lines += ["", "state: done (the run, or its last resumed continuation, finished), else MLflow's status at the "
                  "step of the last validation;"]
    if unfinished:
        lines.append(f"  {unfinished} unfinished run(s) are shown but left out of the means and deltas;")
    lines += ["final: the last validation loss; tail: the mean validation loss over the last k validations "
              "(model.tail_k);",
              f"delta: this run's {metric} minus that of the standard-residual run of the same seed and lr "
              "(- when there is none);",
              "+- std: the spread of a method's deltas over its paired runs (- with fewer than two)."]
    return "\n".join(lines)


def build_compare_parser():
    parser = command_parser("compare", COMPARE_HELP)
    parser.add_argument("--sweep", required=True, help="sweep id printed by `sweep`")
    parser.add_argument("--tracking_uri", "--tracking-uri", action="append", default=None,
                        help=f"MLflow store; repeat to pool several (default {DEFAULT_TRACKING_URI})")
    parser.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment")
    parser.add_argument("--metric", default="tail_mean", choices=("tail_mean", "final"),
                        help="what the deltas compare: tail_mean (mean over the last k validations) or final")
    parser.add_argument("--json", default=None, help="also write rows and summary to this JSON file")
    return parser


@exits_on_user_error()
def compare_main(argv: Optional[list[str]] = None) -> int:
    args = build_compare_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    rows = chain_runs(collect_runs(args.sweep, args.tracking_uri or [DEFAULT_TRACKING_URI], args.experiment))
    add_paired_deltas(rows, args.metric)  # its message for two baselines names the pairing it cannot make
    check_duplicates(rows)
    summary = summarize(rows, args.metric)
    print(format_table(rows, summary, args.metric))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"sweep": args.sweep, "metric": args.metric, "rows": rows, "summary": summary}, fh, indent=2)
    return 0
