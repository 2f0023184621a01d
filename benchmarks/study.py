"""The long-horizon routing study (docs/study.md): a corpus, runs in resumable pieces on one GPU, a report.

    python benchmarks/study.py corpus OUT
    python benchmarks/study.py run --corpus OUT --arms baseline,H1,H8 --seeds 1,2 --until 20000 --minutes 9.5
    python benchmarks/study.py report

`run` starts (or resumes from its newest last*.ckpt) every requested (arm, seed) as its own
`python -m mhar_lit fit` process, side by side on one GPU, each with its own folder and MLflow sqlite store
under --root (default benchmarks/results/study/runs/<arm>-s<seed>/). A piece ends at --until steps
(trainer.max_steps; the schedule's length is model.decay_steps of the base config, so it never moves) or at a
wall-clock deadline --minutes after the start minus --margin seconds, where a callback (StopAtDeadline) asks
Lightning to stop: the run then validates, writes last.ckpt and exits cleanly. A run folder records its config
(study.json): a run is never restarted from scratch once it has a checkpoint, and a run of another config
(base or arm file contents, seed, corpus) is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / "benchmarks/results/study"
DEFAULT_BASE = REPO / "configs/study/base.yaml"
ARMS = {  # arm -> method overlay (docs/study.md says what each tests)
    "baseline": "configs/methods/baseline.yaml",
    "H1": "configs/methods/single-head.yaml",
    "H4": "configs/study/arms/H4.yaml",
    "H8": "configs/methods/mhar.yaml",
    "H16": "configs/study/arms/H16.yaml",
    "H8-sqrt": "configs/study/arms/H8-sqrt.yaml",
    "H8-lr": "configs/study/arms/H8-lr.yaml",
}
EXPERIMENT = "study"
CORPUS_SUFFIXES = {".py": "python", ".md": "docs", ".rst": "docs", ".txt": "docs", ".h": "headers",
                   ".hpp": "headers", ".hh": "headers", ".hxx": "headers"}
MAX_FILE_BYTES = 1 << 20  # larger files are generated tables and vendored bundles, not text to learn from
SHARD_BYTES = 64 << 20


# ---------------------------------------------------------------------------------------------- corpus
def corpus_roots() -> list[Path]:
    """The offline text of this machine: the stdlib, every site-packages folder, /usr/include."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages(), "/usr/include"}
    return sorted(Path(r).resolve() for r in roots if Path(r).is_dir())


def _corpus_files(roots: list[Path]):
    seen_paths = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if path.suffix.lower() in CORPUS_SUFFIXES and path.resolve() not in seen_paths:
                    seen_paths.add(path.resolve())
                    yield path


def build_corpus(out: Path, roots: Optional[list[Path]] = None) -> dict[str, Any]:
    """Deduplicated (sha256 of the content) UTF-8 documents as jsonl shards {"text", "source"} under `out`,
    with manifest.json. Idempotent: a complete manifest is returned as is; an interrupted build starts over."""
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("complete"):
            return manifest
    roots = roots or corpus_roots()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.jsonl"):
        old.unlink()
    stats = {"files_seen": 0, "skipped_large": 0, "skipped_not_utf8": 0, "duplicates": 0, "unique_docs": 0,
             "bytes": 0, "by_kind": {}}
    hashes: set[bytes] = set()
    shard, shard_bytes, shard_index = None, 0, 0
    for path in _corpus_files(roots):
        stats["files_seen"] += 1
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if len(raw) > MAX_FILE_BYTES:
            stats["skipped_large"] += 1
            continue
        digest = hashlib.sha256(raw).digest()
        if digest in hashes:
            stats["duplicates"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats["skipped_not_utf8"] += 1
            continue
        if not text.strip():
            continue
        hashes.add(digest)
        if shard is None or shard_bytes >= SHARD_BYTES:
            if shard is not None:
                shard.close()
            shard, shard_bytes = open(out / f"part-{shard_index:05d}.jsonl", "w", encoding="utf-8"), 0
            shard_index += 1
        line = json.dumps({"text": text, "source": str(path)}, ensure_ascii=False) + "\n"
        shard.write(line)
        shard_bytes += len(line)
        kind = CORPUS_SUFFIXES[path.suffix.lower()]
        stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + len(raw)
        stats["unique_docs"] += 1
        stats["bytes"] += len(raw)
    if shard is not None:
        shard.close()
    manifest = {**stats, "shards": shard_index, "roots": [str(r) for r in roots], "complete": True}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


# ---------------------------------------------------------------------------------------------- run
class StopAtDeadline(L.Callback):
    """Asks Lightning to stop after the first optimizer step past `deadline` (seconds since the epoch): the fit
    then ends as at max_steps (a validation, last.ckpt, a clean exit). Given to each run by `run`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if time.time() >= self.deadline:
            trainer.should_stop = True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_identity(base: Path, arm: str, seed: int, corpus: Path, overrides: list[str]) -> dict[str, Any]:
    """What makes a run's training what it is: mixing pieces that differ in any of these is refused."""
    overlay = REPO / ARMS[arm]
    return {"arm": arm, "seed": seed, "base": str(base), "base_sha256": _sha256(base), "overlay": ARMS[arm],
            "overlay_sha256": _sha256(overlay), "corpus": str(corpus.resolve()), "overrides": list(overrides)}


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest last*.ckpt of any piece of this run (each piece checkpoints into its own folder)."""
    found = [p for p in (run_dir / "ckpt").rglob("last*.ckpt") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def checkpoint_step(path: Path) -> int:
    import torch

    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["global_step"])


def prepare_run_dir(root: Path, identity: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The run's folder and record; refuses a folder of another config, or one whose checkpoint vanished."""
    run_dir = root / "runs" / f"{identity['arm']}-s{identity['seed']}"
    record_path = run_dir / "study.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"identity": identity, "step": 0}
    if record["identity"] != identity:
        differ = sorted(k for k in identity if record["identity"].get(k) != identity[k])
        raise SystemExit(f"{run_dir} holds a run of another config (differs in {', '.join(differ)}): "
                         "use another --root, or remove that folder to start it again")
    if record["step"] > 0 and newest_checkpoint(run_dir) is None:
        raise SystemExit(f"{run_dir} reached step {record['step']} but holds no last*.ckpt: refusing to restart it "
                         "from scratch (restore its checkpoints, or remove the folder)")
    run_dir.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1))
    return run_dir, record


def fit_command(run_dir: Path, identity: dict[str, Any], until: int, deadline: float, cache_dir: Path,
                ckpt: Optional[Path]) -> list[str]:
    callbacks = [{"class_path": "benchmarks.study.StopAtDeadline", "init_args": {"deadline": deadline}}]
    return [
        sys.executable, "-m", "mhar_lit", "fit",
        "--config", identity["base"], "--config", str(REPO / identity["overlay"]),
        *identity["overrides"],
        "--seed_everything", str(identity["seed"]),
        "--data.data", identity["corpus"],
        "--data.cache_dir", str(cache_dir),
        "--trainer.max_steps", str(until),
        "--trainer.default_root_dir", str(run_dir / "ckpt"),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{run_dir / 'mlflow.db'}",
        "--trainer.logger.init_args.experiment_name", EXPERIMENT,
        "--trainer.logger.init_args.run_name", f"{identity['arm']}-s{identity['seed']}",
        "--trainer.callbacks", json.dumps(callbacks),
        *(["--ckpt_path", str(ckpt)] if ckpt else []),
    ]


def prepare_data_once(base: Path, corpus: Path, cache_dir: Path, overrides: list[str]) -> None:
    """Train the BPE and tokenize the corpus in this process before the runs start: side by side they would
    each build the same cache at once."""
    import yaml

    from mhar_lit.data.datamodule import TokenDataModule

    data = dict(yaml.safe_load(base.read_text()).get("data") or {})
    for flag, value in zip(overrides[::2], overrides[1::2]):
        if flag.startswith("--data."):
            data[flag.removeprefix("--data.")] = yaml.safe_load(value)
    data.update(data=str(corpus.resolve()), cache_dir=str(cache_dir))
    TokenDataModule(**data).prepare_data()


def prune_checkpoints(run_dir: Path, keep: Path) -> None:
    """Only the newest last.ckpt is needed to resume: older pieces' checkpoints and MLflow's artifact copies
    of them (a 100M run writes ~0.6 GB per copy) are removed."""
    for path in list((run_dir / "ckpt").rglob("*.ckpt")) + list((run_dir / "mlruns").rglob("*.ckpt")):
        if path.resolve() != keep.resolve():
            path.unlink()
            sidecar = path.with_name(path.name + ".sha256")
            if sidecar.exists():
                sidecar.unlink()


def _flag(item: str) -> list[str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE (e.g. data.num_workers=4), got {item!r}")
    return [f"--{key.removeprefix('--')}", value]


def run_stage(args: argparse.Namespace) -> int:
    start = time.time()
    deadline = start + args.minutes * 60 - args.margin
    root, base, corpus = Path(args.root), Path(args.base).resolve(), Path(args.corpus)
    overrides = [part for item in args.set for part in _flag(item)]
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    if not corpus.exists():
        raise SystemExit(f"corpus {corpus} not found (write it with `python benchmarks/study.py corpus {corpus}`)")
    runs = [prepare_run_dir(root, run_identity(base, a, s, corpus, overrides)) for a in arms for s in seeds]
    cache_dir = root / "data_cache"
    prepare_data_once(base, corpus, cache_dir, overrides)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for run_dir, record in runs:
        if record["step"] >= args.until:
            print(f"{run_dir.name}: at step {record['step']} >= {args.until}, nothing to do")
            continue
        ckpt = newest_checkpoint(run_dir)
        cmd = fit_command(run_dir, record["identity"], args.until, deadline, cache_dir, ckpt)
        piece = len(list((run_dir / "logs").glob("piece-*.log"))) if (run_dir / "logs").is_dir() else 0
        (run_dir / "logs").mkdir(exist_ok=True)
        log = open(run_dir / "logs" / f"piece-{piece:03d}.log", "w")
        print(f"{run_dir.name}: {'resuming ' + str(ckpt) if ckpt else 'starting'} (log {log.name})")
        procs.append((run_dir, record, subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log,
                                                        stderr=subprocess.STDOUT), log))
    failed = _wait(procs, start + args.minutes * 60)
    for run_dir, record, proc, log in procs:
        log.close()
        ckpt = newest_checkpoint(run_dir)
        if ckpt is not None:
            record["step"] = checkpoint_step(ckpt)
            (run_dir / "study.json").write_text(json.dumps(record, indent=1))
            if not args.keep_checkpoints:
                prune_checkpoints(run_dir, ckpt)
        print(f"{run_dir.name}: rc {proc.returncode}, step {record['step']}")
    return 1 if failed else 0


def _wait(procs: list, hard_deadline: float) -> bool:
    """Wait for every run; past `hard_deadline` (a run that did not stop at its soft deadline) send SIGTERM:
    it exits without a new checkpoint and resumes from its previous one."""
    for _, _, proc, _ in procs:
        try:
            proc.wait(timeout=max(hard_deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    return any(proc.returncode != 0 for _, _, proc, _ in procs)


# ---------------------------------------------------------------------------------------------- report
def _history(client, run_ids: list[str], key: str) -> dict[int, float]:
    """A metric over every piece (MLflow run) of one study run, by step; a later piece wins on a shared step."""
    merged: dict[int, float] = {}
    for run_id in run_ids:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            merged[int(m.step)] = float(m.value)
    return dict(sorted(merged.items()))


def scheduled_validations(run_dir: Path, every: int) -> dict[int, float]:
    """{optimizer step: val loss} of the scheduled validations, from the newest checkpoint's val_history (in
    order, one per `every` steps; the extra validation of a piece that stopped between two is not in it).
    Read there, not from MLflow: after a resume from a checkpoint written at a mid-interval stop, Lightning's
    logging step of the resumed piece runs one behind the optimizer step (its `_batches_that_stepped`)."""
    import torch

    ckpt = newest_checkpoint(run_dir)
    if ckpt is None:
        return {}
    history = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False)["mhar_lit"]["val_history"]
    return {(i + 1) * every: float(v) for i, v in enumerate(history)}


def read_run(run_dir: Path, every: int) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"]) if experiment else []
    ids = [r.info.run_id for r in runs]
    record = json.loads((run_dir / "study.json").read_text())
    return {"arm": record["identity"]["arm"], "seed": record["identity"]["seed"], "step": record["step"],
            "pieces": len(ids), "val": scheduled_validations(run_dir, every),
            # the routing monitor logs at global_step - 1 (Lightning's step of the batch): + 1 is the step count
            **{name: {s + 1: v for s, v in _history(client, ids, key).items()} for name, key in
               (("entropy", "routing/entropy"), ("lr_sum", "train/lr_sum"), ("routing_lr_sum", "train/routing_lr_sum"))}}


def tail_mean(val: dict[int, float], until: int, k: int) -> Optional[float]:
    """Mean of the last k scheduled validations at or before step `until`."""
    scheduled = [v for s, v in val.items() if s <= until]
    return sum(scheduled[-k:]) / len(scheduled[-k:]) if scheduled else None


def _last_at(history: dict[int, float], until: int) -> Optional[float]:
    values = [v for s, v in history.items() if s <= until]
    return values[-1] if values else None


def _spread(values: list[float]) -> Optional[dict[str, Any]]:
    """Mean, sample std, min and max over seeds (None without values)."""
    if not values:
        return None
    n = len(values)
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else None
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "seeds": n}


def summarise(runs: list[dict[str, Any]], every: int, k: int) -> dict[str, Any]:
    """Per run and per arm, at the step every run has reached (so that paired deltas compare equal training)."""
    common = min(r["step"] for r in runs)
    per_run = {}
    for r in runs:
        per_run[f"{r['arm']}-s{r['seed']}"] = {
            "arm": r["arm"], "seed": r["seed"], "steps": r["step"], "pieces": r["pieces"],
            "tail_mean_val_loss": tail_mean(r["val"], common, k),
            "entropy_fraction_of_uniform": _last_at(r["entropy"], common),
            "lr_sum": _last_at(r["lr_sum"], common), "routing_lr_sum": _last_at(r["routing_lr_sum"], common)}
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = {r["seed"]: per_run[f"{arm}-s{r['seed']}"] for r in runs if r["arm"] == arm}
        entry = {key: _spread([m[key] for m in mine.values() if m[key] is not None])
                 for key in ("tail_mean_val_loss", "entropy_fraction_of_uniform", "lr_sum", "routing_lr_sum")}
        for ref in ("baseline", "H1"):
            deltas = [m["tail_mean_val_loss"] - per_run[f"{ref}-s{s}"]["tail_mean_val_loss"]
                      for s, m in mine.items() if f"{ref}-s{s}" in per_run and arm != ref
                      and m["tail_mean_val_loss"] is not None
                      and per_run[f"{ref}-s{s}"]["tail_mean_val_loss"] is not None]
            entry[f"delta_vs_{ref}"] = _spread(deltas)
        arms[arm] = entry
    return {"common_step": common, "validation_every": every, "tail_k": k, "runs": per_run, "arms": arms}


def plot(runs: list[dict[str, Any]], key: str, ylabel: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    colours = {arm: f"C{i}" for i, arm in enumerate(dict.fromkeys(r["arm"] for r in runs))}
    labelled = set()
    for r in runs:
        if r[key]:
            steps, values = zip(*r[key].items())
            ax.plot(steps, values, color=colours[r["arm"]], label=None if r["arm"] in labelled else r["arm"],
                    linestyle="-" if r["seed"] == min(x["seed"] for x in runs) else "--")
            labelled.add(r["arm"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report_stage(args: argparse.Namespace) -> int:
    import yaml

    root = Path(args.root)
    run_dirs = sorted(p.parent for p in (root / "runs").glob("*/study.json"))
    if not run_dirs:
        raise SystemExit(f"no runs under {root / 'runs'}")
    base = yaml.safe_load(Path(json.loads((run_dirs[0] / "study.json").read_text())["identity"]["base"]).read_text())
    every, k = int(base["trainer"]["val_check_interval"]), int(base["model"].get("tail_k", 11))
    runs = [read_run(d, every) for d in run_dirs]
    summary = summarise(runs, every, k)
    (root / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    plot(runs, "val", "validation loss", root / "loss.png")
    plot(runs, "entropy", "per-token routing entropy / log N (1 = uniform)", root / "entropy.png")
    print(json.dumps(summary["arms"], indent=1))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    corpus = sub.add_parser("corpus", help="assemble the offline text corpus")
    corpus.add_argument("out")
    run = sub.add_parser("run", help="start or resume runs for one piece")
    run.add_argument("--corpus", required=True, help="the folder written by the corpus stage")
    run.add_argument("--arms", required=True, help=f"comma-separated, of {', '.join(ARMS)}")
    run.add_argument("--seeds", default="1")
    run.add_argument("--until", type=int, required=True, help="stop each run at this optimizer step")
    run.add_argument("--minutes", type=float, required=True, help="wall-clock budget of this piece")
    run.add_argument("--margin", type=float, default=90.0,
                     help="seconds before the budget's end at which runs are asked to stop (validation, checkpoint)")
    run.add_argument("--base", default=str(DEFAULT_BASE))
    run.add_argument("--root", default=str(DEFAULT_ROOT))
    run.add_argument("--keep_checkpoints", action="store_true", help="do not prune older checkpoints")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="an extra fit setting (e.g. data.num_workers=4), part of the runs' identity; repeatable")
    report = sub.add_parser("report", help="summary.json, loss.png and entropy.png from every run's store")
    report.add_argument("--root", default=str(DEFAULT_ROOT))
    args = parser.parse_args(argv)
    if args.stage == "corpus":
        manifest = build_corpus(Path(args.out))
        print(json.dumps({k: v for k, v in manifest.items() if k != "roots"}, indent=1))
        return 0
    return run_stage(args) if args.stage == "run" else report_stage(args)


if __name__ == "__main__":
    sys.exit(main())
