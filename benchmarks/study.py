"""The routing study (docs/study.md): a corpus, sets of runs in resumable pieces on one GPU, small exports.

    python benchmarks/study.py corpus OUT
    python benchmarks/study.py piece SET --out DIR [--commit SHA] [--budget_s 560]
    python benchmarks/study.py print-call SET          (here: the device call of one piece, with this commit)
    python benchmarks/study.py piece SET --tiny --out DIR --root DIR   (the same pipeline on the CPU)

A set (SETS) is at most four (arm, seed) runs. `piece` builds the corpus if it is missing,
starts or resumes (from its newest last.ckpt) every run of the set as its own `python -m mhar_lit fit` process,
side by side on one GPU, each with its own folder and MLflow sqlite store under --root (default runs/study/,
which git ignores, so a warm device machine keeps it between two calls). The whole piece, data preparation and
export included, ends within --budget_s: each run is asked to stop --margin_s before that (StopAtDeadline: it
validates, writes last.ckpt, exits), one that does not is sent SIGTERM. The piece then writes to --out only what
the report needs: study-SET.json (every run's identity, scheduled validations and metric histories, read from its
checkpoint and MLflow store), and the set's own summary and plots (benchmarks/study_report.py). A run folder
records its config (study.json): a run is never restarted from scratch once it has a checkpoint, and a run of
another config is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/study.py` puts benchmarks/ first, not the root that holds mhar_lit
    sys.path.insert(0, str(REPO))
DEFAULT_ROOT = REPO / "runs/study"  # git-ignored: survives between two calls on the same device machine
DEFAULT_BASE = REPO / "configs/study/base.yaml"
TINY_BASE = REPO / "configs/study/tiny.yaml"
ARMS_DIR = REPO / "configs/study/arms"
# arm -> method overlay, in the report's order (docs/study.md says what each tests); the extras last
ARMS = {"baseline": "configs/methods/baseline.yaml", "H1": "configs/methods/single-head.yaml",
        "H8": "configs/methods/mhar.yaml",
        **{arm: f"configs/study/arms/{arm}.yaml" for arm in
           ("H8-heads", "H8-lr", "H1-lr", "H4-heads", "H16-heads", "H8-sqrt", "H8-bf16")}}
# The runs in sets of at most four, each set side by side on one GPU in two pieces of under 10 minutes on the same
# machine (docs/study.md), in this order: a1 holds the comparison that matters most (H8-heads against H1 and H8),
# b1 the control and the shape in H; a2 and b2 are the second seed; x the extras.
SETS = {
    "a1": ["baseline:1", "H1:1", "H8:1", "H8-heads:1"],
    "b1": ["H8-lr:1", "H1-lr:1", "H4-heads:1", "H16-heads:1"],
    "a2": ["baseline:2", "H1:2", "H8:2", "H8-heads:2"],
    "b2": ["H8-lr:2", "H1-lr:2", "H4-heads:2", "H16-heads:2"],
    "x": ["H8-bf16:1", "H8-sqrt:1", "H8-sqrt:2"],
}
EXPERIMENT = "study"
EXPORT_METRICS = {  # exported name -> MLflow key
    "train_loss": "train/loss", "entropy": "routing/entropy", "logit_spread": "routing/logit_spread",
    "lr_sum": "train/lr_sum", "routing_lr_sum": "train/routing_lr_sum", "tokens_per_s": "train/tokens_per_s"}
LOG_TAIL_LINES = 30
MIN_START_S = 90  # a run started with less time than this before SIGTERM could not reach its first checkpoint
CORPUS_SUFFIXES = {".py": "python", ".md": "docs", ".rst": "docs", ".txt": "docs", ".h": "headers",
                   ".hpp": "headers", ".hh": "headers", ".hxx": "headers"}
MAX_FILE_BYTES = 1 << 20  # larger files are generated tables and vendored bundles, not text to learn from
SHARD_BYTES = 64 << 20
# ~100M BPE-8192 tokens at ~3.8 bytes/token: more than the 82M tokens of 5,000 steps (no text seen twice), and a
# bounded time to train the tokenizer and tokenize it at the start of a set's first piece
CORPUS_MAX_BYTES = 384 << 20
TINY_CORPUS_BYTES = 1 << 20
WHEEL_INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                 "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site")


# ---------------------------------------------------------------------------------------------- corpus
def corpus_roots() -> list[Path]:
    """The offline text of this machine: the stdlib first and /usr/include (so that the size cap never drops
    them), then every site-packages folder in sorted order."""
    import site
    import sysconfig

    first = [Path(sysconfig.get_paths()["stdlib"]).resolve(), Path("/usr/include").resolve()]
    rest = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    rest |= set(site.getsitepackages()) | {site.getusersitepackages()}
    roots = first + sorted({Path(r).resolve() for r in rest} - set(first))
    return [r for r in roots if r.is_dir()]


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


def _corpus_documents(roots: list[Path], stats: dict[str, Any]):
    """(path, raw bytes, text) of every usable file, each content once; counts what was skipped in `stats`."""
    hashes: set[bytes] = set()
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
        if text.strip():
            hashes.add(digest)
            yield path, raw, text


def build_corpus(out: Path, roots: Optional[list[Path]] = None, max_bytes: int = CORPUS_MAX_BYTES) -> dict[str, Any]:
    """Deduplicated (sha256 of the content) UTF-8 documents as jsonl shards {"text", "source"} under `out`, in
    sorted path order until the next one would pass `max_bytes`, with manifest.json (its `content_sha256` names
    the documents in order: two machines with the same one trained on the same text). Idempotent: a complete
    manifest of the same cap is returned as is; an interrupted build starts over."""
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("complete") and manifest.get("max_bytes") == max_bytes:
            return manifest
    roots = roots or corpus_roots()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.jsonl"):
        old.unlink()
    stats = {"files_seen": 0, "skipped_large": 0, "skipped_not_utf8": 0, "duplicates": 0, "unique_docs": 0,
             "bytes": 0, "by_kind": {}}
    content = hashlib.sha256()
    shard, shard_bytes, shard_index = None, 0, 0
    for path, raw, text in _corpus_documents(roots, stats):
        if stats["bytes"] + len(raw) > max_bytes:
            break
        if shard is None or shard_bytes >= SHARD_BYTES:
            if shard is not None:
                shard.close()
            shard, shard_bytes = open(out / f"part-{shard_index:05d}.jsonl", "w", encoding="utf-8"), 0
            shard_index += 1
        line = json.dumps({"text": text, "source": str(path)}, ensure_ascii=False) + "\n"
        shard.write(line)
        shard_bytes += len(line)
        content.update(hashlib.sha256(raw).digest())
        kind = CORPUS_SUFFIXES[path.suffix.lower()]
        stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + len(raw)
        stats["unique_docs"] += 1
        stats["bytes"] += len(raw)
    if shard is not None:
        shard.close()
    manifest = {**stats, "shards": shard_index, "max_bytes": max_bytes, "content_sha256": content.hexdigest(),
                "roots": [str(r) for r in roots], "complete": True}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


# ---------------------------------------------------------------------------------------------- sets
def parse_run(item: str) -> tuple[str, int]:
    """'ARM:SEED' -> (arm, seed); one clear line for anything else."""
    arm, sep, seed = str(item).partition(":")
    if not sep or not seed.isdigit():
        raise SystemExit(f"a study run is ARM:SEED (e.g. H8-heads:1), got {item!r}")
    if arm not in ARMS:
        raise SystemExit(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    return arm, int(seed)


def resolve_runs(spec: str) -> tuple[str, list[tuple[str, int]]]:
    """A set's name (SETS), or ARM:SEED,ARM:SEED,...: (the label of its export, the runs)."""
    if spec in SETS:
        return spec, [parse_run(item) for item in SETS[spec]]
    if ":" not in spec:
        raise SystemExit(f"no set {spec!r}: the sets are {', '.join(SETS)}, or give ARM:SEED,... (e.g. H8-heads:1)")
    runs = [parse_run(item) for item in spec.split(",")]
    return "_".join(f"{arm}-s{seed}" for arm, seed in runs), runs


# ---------------------------------------------------------------------------------------------- runs
class StopAtDeadline(L.Callback):
    """Asks Lightning to stop after the first optimizer step past `deadline` (seconds since the epoch): the fit
    then ends as at max_steps (a validation, last.ckpt, a clean exit). Given to each run by `piece`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if time.time() >= self.deadline:
            trainer.should_stop = True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def arm_precision(base: Path, arm: str) -> str:
    """trainer.precision of the base config with the arm's overlay over it."""
    import yaml

    trainer = {**(yaml.safe_load(base.read_text()).get("trainer") or {}),
               **(yaml.safe_load((REPO / ARMS[arm]).read_text()).get("trainer") or {})}
    return str(trainer.get("precision", "32-true"))


def run_identity(base: Path, arm: str, seed: int, corpus: Path, manifest: dict[str, Any],
                 overrides: list[str]) -> dict[str, Any]:
    """What makes a run's training what it is: mixing pieces that differ in any of these is refused."""
    overlay = REPO / ARMS[arm]
    return {"arm": arm, "seed": seed, "base": str(base), "base_sha256": _sha256(base), "overlay": ARMS[arm],
            "overlay_sha256": _sha256(overlay), "precision": arm_precision(base, arm),
            "corpus": str(corpus.resolve()), "corpus_sha256": manifest["content_sha256"],
            "overrides": list(overrides)}


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest last*.ckpt of any piece of this run (each piece checkpoints into its own folder)."""
    found = [p for p in (run_dir / "ckpt").rglob("last*.ckpt") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def _load_checkpoint(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


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
    record.setdefault("pieces", [])
    record_path.write_text(json.dumps(record, indent=1))
    return run_dir, record


def fit_command(run_dir: Path, identity: dict[str, Any], deadline: float, cache_dir: Path,
                ckpt: Optional[Path]) -> list[str]:
    """The run's `fit`; the arm's name is its MLflow run name and `study_arm` tag (the strategy's method label
    need not tell the arms apart)."""
    callbacks = [{"class_path": "benchmarks.study.StopAtDeadline", "init_args": {"deadline": deadline}}]
    name = f"{identity['arm']}-s{identity['seed']}"
    return [
        sys.executable, "-m", "mhar_lit", "fit",
        "--config", identity["base"], "--config", str(REPO / identity["overlay"]),
        *identity["overrides"],
        "--seed_everything", str(identity["seed"]),
        "--data.data", identity["corpus"],
        "--data.cache_dir", str(cache_dir),
        "--trainer.default_root_dir", str(run_dir / "ckpt"),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{run_dir / 'mlflow.db'}",
        "--trainer.logger.init_args.experiment_name", EXPERIMENT,
        "--trainer.logger.init_args.run_name", name,
        "--trainer.logger.init_args.tags", json.dumps({"study_arm": identity["arm"],
                                                       "study_seed": str(identity["seed"])}),
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
    of them (a 100M bf16 run writes ~0.3 GB per copy) are removed."""
    for path in list((run_dir / "ckpt").rglob("*.ckpt")) + list((run_dir / "mlruns").rglob("*.ckpt")):
        if path.resolve() != keep.resolve():
            path.unlink()
            sidecar = path.with_name(path.name + ".sha256")
            if sidecar.exists():
                sidecar.unlink()


def _flag(item: str) -> list[str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--fit takes KEY=VALUE (e.g. data.num_workers=4), got {item!r}")
    return [f"--{key.removeprefix('--')}", value]


def _start_run(run_dir: Path, record: dict[str, Any], deadline: float, cache_dir: Path, env: dict[str, str]):
    ckpt = newest_checkpoint(run_dir)
    cmd = fit_command(run_dir, record["identity"], deadline, cache_dir, ckpt)
    (run_dir / "logs").mkdir(exist_ok=True)
    log_path = run_dir / "logs" / f"piece-{len(record['pieces']):03d}.log"
    print(f"{run_dir.name}: {'resuming from step ' + str(record['step']) if ckpt else 'starting'} (log {log_path})",
          flush=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT), log_path


def _wait(procs: list[subprocess.Popen], hard_deadline: float) -> None:
    """Wait for every run; past `hard_deadline` (a run that did not stop at its soft deadline) send SIGTERM:
    it exits without a new checkpoint and resumes from its previous one."""
    for proc in procs:
        try:
            proc.wait(timeout=max(hard_deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_piece(root: Path, base: Path, runs: list[tuple[str, int]], corpus: Path, manifest: dict[str, Any],
              overrides: list[str], deadline: float, hard_deadline: float, keep_checkpoints: bool) -> bool:
    """One piece of every run of the set; True when every started run exited cleanly."""
    prepared = [prepare_run_dir(root, run_identity(base, arm, seed, corpus, manifest, overrides))
                for arm, seed in runs]
    cache_dir = root / "data_cache"
    prepare_data_once(base, corpus, cache_dir, overrides)
    until = int(_base_config(base)["trainer"]["max_steps"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    started = []
    for run_dir, record in prepared:
        if record["step"] >= until:
            print(f"{run_dir.name}: at step {record['step']} of {until}, nothing to do", flush=True)
            continue
        if hard_deadline - time.time() < MIN_START_S:  # the next piece trains on the cached tokens instead
            print(f"{run_dir.name}: not started, too little of the piece is left after preparing the data", flush=True)
            continue
        started.append((run_dir, record, time.time(), *_start_run(run_dir, record, deadline, cache_dir, env)))
    _wait([proc for *_, proc, _ in started], hard_deadline)
    for run_dir, record, began, proc, log_path in started:
        ckpt = newest_checkpoint(run_dir)
        step_before = record["step"]
        if ckpt is not None:
            record["step"] = int(_load_checkpoint(ckpt)["global_step"])
            if not keep_checkpoints:
                prune_checkpoints(run_dir, ckpt)
        record["pieces"].append({"rc": proc.returncode, "seconds": round(time.time() - began, 1),
                                 "from_step": step_before, "to_step": record["step"], "log": log_path.name})
        (run_dir / "study.json").write_text(json.dumps(record, indent=1))
        print(f"{run_dir.name}: rc {proc.returncode}, step {step_before} -> {record['step']}", flush=True)
    return all(proc.returncode == 0 for *_, proc, _ in started)


def _base_config(base: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(base.read_text())


# ---------------------------------------------------------------------------------------------- export
def scheduled_validations(run_dir: Path, every: int) -> dict[int, float]:
    """{optimizer step: val loss} of the scheduled validations, from the newest checkpoint's val_history (in
    order, one per `every` steps; the extra validation of a piece that stopped between two is not in it).
    Read there, not from MLflow: after a resume from a checkpoint written at a mid-interval stop, Lightning's
    logging step of the resumed piece runs one behind the optimizer step (its `_batches_that_stepped`)."""
    ckpt = newest_checkpoint(run_dir)
    if ckpt is None:
        return {}
    history = _load_checkpoint(ckpt)["mhar_lit"]["val_history"]
    return {(i + 1) * every: float(v) for i, v in enumerate(history)}


def _metric_histories(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, list[list[float]]]]:
    """The MLflow runs (one per piece) of a study run and each exported metric over all of them, as [step, value]
    with step = optimizer steps done (Lightning logs a training step's metrics at the 0-based batch index); a later
    piece wins on a shared step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"]) if experiment else []
    pieces = [{"run_id": r.info.run_id, "status": r.info.status, "start_time": r.info.start_time,
               "end_time": r.info.end_time, "study_arm": r.data.tags.get("study_arm")} for r in runs]
    histories = {}
    for name, key in EXPORT_METRICS.items():
        merged: dict[int, float] = {}
        for run in runs:
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
                merged[int(m.step) + 1] = float(m.value)
        histories[name] = [[s, v] for s, v in sorted(merged.items())]
    return pieces, histories


def _log_tail(run_dir: Path) -> list[str]:
    logs = sorted((run_dir / "logs").glob("piece-*.log")) if (run_dir / "logs").is_dir() else []
    return logs[-1].read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if logs else []


def export_run(run_dir: Path, every: int, tail_k: int) -> dict[str, Any]:
    """One run as the report reads it (benchmarks/study_report.py): no checkpoint, only numbers."""
    record = json.loads((run_dir / "study.json").read_text())
    mlflow_runs, metrics = _metric_histories(run_dir)
    val = scheduled_validations(run_dir, every)
    return {"arm": record["identity"]["arm"], "seed": record["identity"]["seed"], "step": record["step"],
            "identity": record["identity"], "pieces": record["pieces"], "mlflow_runs": mlflow_runs,
            "validation_every": every, "tail_k": tail_k, "val": [[s, v] for s, v in val.items()],
            "metrics": metrics, "log_tail": _log_tail(run_dir)}


def export_set(root: Path, base: Path, runs: list[tuple[str, int]], out: Path, set_name: str,
               piece: dict[str, Any]) -> Path:
    config = _base_config(base)
    every, tail_k = int(config["trainer"]["val_check_interval"]), int(config["model"].get("tail_k", 11))
    exported = [export_run(root / "runs" / f"{arm}-s{seed}", every, tail_k) for arm, seed in runs
                if (root / "runs" / f"{arm}-s{seed}" / "study.json").is_file()]
    schedule = {k: config["model"].get(k) for k in ("lr", "warmup_steps", "decay_steps", "min_lr_ratio")}
    schedule["max_steps"] = int(config["trainer"]["max_steps"])
    path = out / f"study-{set_name}.json"
    path.write_text(json.dumps({"set": set_name, "piece": piece, "schedule": schedule, "runs": exported}, indent=1,
                               allow_nan=False))
    return path


# ---------------------------------------------------------------------------------------------- stages
def _device_facts() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


def piece_stage(args: argparse.Namespace) -> int:
    start = args.started_at or time.time()
    deadline, hard_deadline = start + args.budget_s - args.margin_s, start + args.budget_s - args.kill_margin_s
    base = Path(args.base or (TINY_BASE if args.tiny else DEFAULT_BASE)).resolve()
    root, out = Path(args.root), Path(args.out)
    corpus = Path(args.corpus) if args.corpus else root / "corpus"
    label, runs = resolve_runs(args.runs)
    overrides = [part for item in args.fit for part in _flag(item)]
    if args.dry_run:
        return _print_plan(args, label, base, runs, corpus, overrides, deadline)
    out.mkdir(parents=True, exist_ok=True)
    manifest = build_corpus(corpus, **({"roots": [_stdlib()], "max_bytes": TINY_CORPUS_BYTES} if args.tiny else {}))
    print(f"corpus {corpus}: {manifest['unique_docs']} documents, {manifest['bytes'] / 2**20:.0f} MiB, "
          f"{time.time() - start:.0f} s into the piece", flush=True)
    ok = run_piece(root, base, runs, corpus, manifest, overrides, deadline, hard_deadline, args.keep_checkpoints)
    piece = {"commit": args.commit, "budget_s": args.budget_s, "seconds": round(time.time() - start, 1),
             "corpus": {k: v for k, v in manifest.items() if k != "roots"}, **_device_facts()}
    exported = export_set(root, base, runs, out, label, piece)
    from benchmarks import study_report

    study_report.write_report([exported], out, suffix=f"-{label}")
    print(f"exported {exported} ({exported.stat().st_size / 1e3:.0f} kB), {time.time() - start:.0f} s in all")
    return 0 if ok else 1


def _stdlib() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def _print_plan(args, label: str, base: Path, runs, corpus: Path, overrides: list[str], deadline: float) -> int:
    """--dry-run: what the piece would run, with no corpus, data or training."""
    print(f"set {label}: {len(runs)} runs, base {base}, root {args.root}, corpus {corpus}, "
          f"stop requested {args.budget_s - args.margin_s:.0f} s after the start")
    manifest = {"content_sha256": "(built by the piece)"}
    for arm, seed in runs:
        identity = run_identity(base, arm, seed, corpus, manifest, overrides)
        run_dir = Path(args.root) / "runs" / f"{arm}-s{seed}"
        print(shlex.join(fit_command(run_dir, identity, deadline, Path(args.root) / "data_cache", None)))
    return 0


def print_call_stage(args: argparse.Namespace) -> int:
    """The device call of one piece of SET, with this checkout's commit; refuses an uncommitted tree or no wheels."""
    resolve_runs(args.runs)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    if status.strip():
        raise SystemExit("the tree has uncommitted changes: commit them first (the study runs the committed code)")
    if not list((REPO / ".whl").glob("*.whl")):
        raise SystemExit(".whl/ has no wheels: run ../shared/tools/gpu-wheels.sh .whl here first")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    command = (f"S=$(date +%s); {WHEEL_INSTALL} || exit 1; export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true; "
               f"python3 benchmarks/study.py piece {args.runs} --out $OUT --commit {commit} --started_at $S")
    print(f'run(command="{command}", carry=[".whl"], timeout_s=600)')
    print("then the same call again at once (the machine stays warm for 30 s): the second piece resumes the first")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    corpus = sub.add_parser("corpus", help="assemble the offline text corpus")
    corpus.add_argument("out")
    piece = sub.add_parser("piece", help="one piece of a set of runs, then their export")
    piece.add_argument("runs", help=f"a set ({', '.join(SETS)}) or ARM:SEED,ARM:SEED,...")
    piece.add_argument("--out", required=True, help="where study-SET.json, its summary and plots go ($OUT)")
    piece.add_argument("--commit", default="unknown", help="the commit of the copied tree, recorded in the export")
    piece.add_argument("--budget_s", type=float, default=560.0, help="wall-clock budget of the whole piece")
    piece.add_argument("--started_at", type=float, help="when the budget began (seconds since the epoch; default "
                                                        "now): the device call's start, before the wheels install")
    piece.add_argument("--margin_s", type=float, default=80.0,
                       help="seconds before the budget's end at which runs are asked to stop (validation, "
                            "checkpoint, export)")
    piece.add_argument("--kill_margin_s", type=float, default=35.0,
                       help="seconds before the budget's end at which a run that did not stop gets SIGTERM")
    piece.add_argument("--tiny", action="store_true", help="the CPU pipeline check: configs/study/tiny.yaml, ~1 MB "
                                                           "of the standard library as the corpus")
    piece.add_argument("--dry-run", action="store_true", help="print the runs' fit commands and exit")
    piece.add_argument("--corpus", help="the corpus folder (default ROOT/corpus, built when missing)")
    piece.add_argument("--base", help=f"default {DEFAULT_BASE.relative_to(REPO)} ({TINY_BASE.relative_to(REPO)} "
                                      "with --tiny)")
    piece.add_argument("--root", default=str(DEFAULT_ROOT))
    piece.add_argument("--keep_checkpoints", action="store_true", help="do not prune older checkpoints")
    piece.add_argument("--fit", action="append", default=[], metavar="KEY=VALUE",
                       help="an extra fit setting (e.g. data.num_workers=4), part of the runs' identity; repeatable")
    call = sub.add_parser("print-call", help="print the device call of one piece of SET")
    call.add_argument("runs", help=f"a set ({', '.join(SETS)}) or ARM:SEED,...")
    args = parser.parse_args(argv)
    if args.stage == "corpus":
        manifest = build_corpus(Path(args.out))
        print(json.dumps({k: v for k, v in manifest.items() if k != "roots"}, indent=1))
        return 0
    return piece_stage(args) if args.stage == "piece" else print_call_stage(args)


if __name__ == "__main__":
    sys.exit(main())
