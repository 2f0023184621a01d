"""End-to-end training throughput of the shipped recipes, through the command line the user runs.

    python benchmarks/fit_throughput.py [--sizes 100M 350M 1B] [--methods baseline mhar block] [--repeats 3]
        [--variants NAME=OVERRIDES ...] [--max-steps N] [--warmup 3] [--extra "--model.cuda_graph true"]
        [--time-budget S] [--out benchmarks/results/fit_throughput.json] [--dry-run]
    python benchmarks/fit_throughput.py --configs demo=configs/demo.yaml --max-steps 6 --repeats 1 --warmup 2
    python benchmarks/fit_throughput.py --merge fit_100M.json fit_350M.json fit_1B.json [--peer peer.json]
        --out benchmarks/results/fit_throughput.json

Variants time the same configs under other overrides, interleaved with the others: e.g. the fused loss and the
two bf16 precisions (the first variant is the reference of the others)
    --variants bf16-true= fused=--model.fused_loss=true mixed=--trainer.precision=bf16-mixed \
               fused+mixed="--model.fused_loss=true --trainer.precision=bf16-mixed"

Each fit is `python -m mhar_lit fit --config configs/paper/SIZE.yaml --config configs/methods/METHOD.yaml` (a
subprocess, as the user starts it) with a short `trainer.max_steps`, validation and checkpoints off, a throwaway MLflow store and root folder.
The methods of a size alternate within the run (baseline, mhar, block, baseline, mhar, ...), so that drift of
the machine is shared by all of them. The shipped configs' corpus and tokenizer paths are placeholders; unless
--keep-data, the fits read the embedded corpus with byte tokens (`--data.data null --data.tokenizer bytes`): the
model keeps the config's vocabulary, so every matmul, the LM head included, has the shipped shape.

What is measured is what the run logs: SpeedMonitor (`--speed.every_n_steps 1`) logs `train/tokens_per_s` of
every optimizer step after its own `skip_steps`, and `train/peak_mem_gb` (torch.cuda.max_memory_allocated, GiB).
The history is read back from the run's MLflow store. Per fit: the median over the steps after `skip_steps +
warmup` (capture, compilation and the first partial windows left out); per (size, method): median, min and max
over the repeats, and ratios against the baseline (of the medians, and the median of the per-repeat ratios).
MFU counts the baseline model's FLOPs per token for every method of a size (Lightning's measure_flops of
forward + backward on the meta device; routing's own arithmetic counts as overhead, so MFU ratios equal
throughput ratios) against Lightning's get_available_flops for the card, or the config's speed.peak_tflops where
Lightning has no entry (it has none for "NVIDIA H200"); the run's own train/mfu (6N + attention, against
speed.peak_tflops) is recorded too.

Writes a JSON (after every fit, so an interrupted run keeps what finished) with the commit, whether the tree
was clean (a dirty tree is refused unless --allow-dirty), device, versions, date and the exact command; prints a
table last. Its `summary[size][method]` holds the medians `tokens_per_s`, `mfu`, `ratio_vs_baseline` (against
the baseline of the same variant) and `peak_mem_ratio`; a variant's method is named `method+variant` and also
gets `ratio_vs_<first variant>` and `peak_mem_ratio_vs_<first variant>`. `labels` holds every label's spread
and paired ratios. --merge joins the reports of one device (one size per device call) into one; --peer adds
litgpt's step from benchmarks/peer_step.py as summary[size]["litgpt"] (its compiled variant where timed: a step
outside `fit`, no peak memory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's mhar_lit, for the FLOP count

from benchmarks.provenance import git_state  # noqa: E402

METHOD_FILES = {"baseline": "baseline.yaml", "mhar": "mhar.yaml", "block": "block-mhar.yaml"}  # configs/methods/
SIZES = ("100M", "350M", "1B")
# capture/compilation (SpeedMonitor's 2 skipped steps) + 3 warm-up steps + the timed steps (10, and 7 at 1B, whose
# steps take about twice as long: 16 eager micro-batches of 2 x 1024 against 8 of 8 x 2048 or 4 x 1024).
DEFAULT_MAX_STEPS = {"100M": 15, "350M": 15, "1B": 12}
FALLBACK_MAX_STEPS = 15
SKIP_STEPS = 2  # SpeedMonitor.skip_steps, passed explicitly so the parsing below does not depend on its default
SPEED_KEY, MEMORY_KEY, RUN_MFU_KEY = "train/tokens_per_s", "train/peak_mem_gb", "train/mfu"
FAR = 10**9  # a step count no benchmark fit reaches: periodic checkpoints and routing monitors never fire


# ------------------------------------------------------------------ the fits

def fit_command(configs: list[str], max_steps: int, work: Path, cache_dir: Path, keep_data: bool,
                extra: list[str]) -> list[str]:
    """The `python -m mhar_lit fit` command line of one benchmark fit (the config files layered in order, its own
    MLflow store and root folder in `work`). Lightning refuses `trainer.enable_checkpointing false` next to the ModelCheckpoint the CLI always
    adds, so checkpoints are pushed past max_steps and the final last.ckpt is switched off instead."""
    cmd = [sys.executable, "-m", "mhar_lit", "fit", *(a for c in configs for a in ("--config", c)),
           "--trainer.max_steps", str(max_steps),
           "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
           "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(work / "runs"),
           "--trainer.logger.init_args.tracking_uri", f"sqlite:///{work / 'mlflow.db'}",
           "--checkpoint.save_last", "false", "--checkpoint.every_n_train_steps", str(FAR),
           "--speed.every_n_steps", "1", "--speed.skip_steps", str(SKIP_STEPS),
           "--routing_monitor.every_n_steps", str(FAR), "--routing_monitor.log_heatmaps", "false",
           "--data.cache_dir", str(cache_dir)]
    if not keep_data:
        cmd += ["--data.data", "null", "--data.tokenizer", "bytes"]
    return cmd + extra


def read_history(tracking_uri: str) -> dict[str, Any]:
    """The single run of a benchmark fit's MLflow store: its status and the step -> value history of the speed,
    memory and MFU metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    if len(runs) != 1:
        raise RuntimeError(f"expected one MLflow run in {tracking_uri}, found {len(runs)}")
    run = runs[0]
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in (SPEED_KEY, MEMORY_KEY, RUN_MFU_KEY)}
    return {"run_id": run.info.run_id, "status": run.info.status, "history": history}


def steady_values(history: dict[int, float], first_step: int) -> list[float]:
    """The per-step values logged at MLflow step >= first_step, in step order.

    With `speed.every_n_steps 1` SpeedMonitor logs at step s the window that ended with optimizer step s + 1,
    from s = skip_steps on. Under gradient accumulation it logs twice more before that, partial windows: at
    skip_steps - 1 (one micro-batch) and skip_steps (the rest of that optimizer step); so first_step >=
    skip_steps + 1 keeps whole optimizer steps only, with or without accumulation."""
    return [history[s] for s in sorted(history) if s >= first_step]


def summarise_fit(history: dict[str, dict[int, float]], first_step: int, flops_per_token: Optional[float],
                  peak_flops: Optional[float], tokens_per_step: Optional[int]) -> dict[str, Any]:
    speed = steady_values(history[SPEED_KEY], first_step)
    if not speed:
        raise RuntimeError(f"no {SPEED_KEY} values at steps >= {first_step} (logged at steps "
                           f"{sorted(history[SPEED_KEY])}): raise --max-steps or lower --warmup")
    median = statistics.median(speed)
    memory = list(history[MEMORY_KEY].values())
    run_mfu = steady_values(history[RUN_MFU_KEY], first_step)
    return {
        "timed_steps": len(speed),
        "tokens_per_s": median, "tokens_per_s_min": min(speed), "tokens_per_s_max": max(speed),
        "step_ms": 1e3 * tokens_per_step / median if tokens_per_step else None,
        "mfu": flops_per_token * median / peak_flops if flops_per_token and peak_flops else None,
        "run_logged_mfu": statistics.median(run_mfu) if run_mfu else None,
        "peak_mem_gib": max(memory) if memory else None,  # max_memory_allocated: the run's peak so far
    }


def run_fit(label: dict, repeat: int, args, work_root: Path, shape: dict) -> dict[str, Any]:
    """One fit as a subprocess; its log goes next to its store, its summary into the report."""
    work = work_root / f"{label['name'].replace('/', '_')}_r{repeat}"
    work.mkdir(parents=True, exist_ok=True)
    max_steps = max_steps_for(label["size"], args.max_steps)
    cmd = fit_command(label["config"], max_steps, work, work_root / "data_cache", args.keep_data,
                      args.extra + label["overrides"])
    result = {"label": label["name"], "size": label["size"], "method": label["method"], "repeat": repeat,
              "max_steps": max_steps, "command": shlex.join(cmd)}
    env = dict(os.environ, PYTHONUNBUFFERED="1", MLFLOW_DISABLE_TELEMETRY="true")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    start = time.time()
    with open(work / "fit.log", "w") as log:
        log.write(result["command"] + "\n")
        log.flush()
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.fit_timeout)
            result["rc"] = done.returncode
        except subprocess.TimeoutExpired:
            result["rc"] = "timeout"
    result["wall_s"] = round(time.time() - start, 1)
    if result["rc"] != 0:
        result["error"] = (work / "fit.log").read_text()[-3000:]
        return result
    try:
        stored = read_history(f"sqlite:///{work / 'mlflow.db'}")
        first_step = SKIP_STEPS + args.warmup
        result.update(run_id=stored["run_id"], status=stored["status"], first_timed_step=first_step,
                      history={k: {str(s): v for s, v in h.items()} for k, h in stored["history"].items()})
        result.update(summarise_fit(stored["history"], first_step, shape.get("flops_per_token"),
                                    shape.get("peak_flops"), shape.get("tokens_per_step")))
    except Exception as exc:  # keep the other fits: the report says what went wrong with this one
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def expected_wall(fits: list[dict], label: dict) -> float:
    """Seconds the next fit of `label` will likely take: its last fit's (the first one of a label also compiles
    kernels and prepares data), else the longest fit so far."""
    same = [f["wall_s"] for f in fits if f["label"] == label["name"]]
    return same[-1] if same else max((f["wall_s"] for f in fits), default=0.0)


def max_steps_for(size: str, override: Optional[int]) -> int:
    return override or DEFAULT_MAX_STEPS.get(size, FALLBACK_MAX_STEPS)


# ------------------------------------------------------------------ shapes, FLOPs and the environment

def resolved_config(label: dict, args) -> dict:
    """The config the fit will run (the files plus this script's overrides, --extra and the variant's), from
    LightningCLI's own --print_config: tokens per step and the model's shape follow whatever they change."""
    import yaml

    config = label["config"]
    cmd = fit_command(config, max_steps_for("", args.max_steps), Path(tempfile.gettempdir()) / "fit_throughput_print",
                      Path("data_cache"), args.keep_data, args.extra + label["overrides"]) + ["--print_config"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' + '.join(config)}: --print_config failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return yaml.safe_load(done.stdout)


def world_size(trainer: dict) -> Optional[int]:
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if isinstance(devices, str) and devices.isdigit() and int(devices) > 0:
        return int(devices) * nodes
    if isinstance(devices, list):
        return len(devices) * nodes
    return None  # "auto" / -1: the count is the machine's, unknown here


def flops_per_token(size: str, overrides: Optional[dict], seq_len: int) -> tuple[float, float]:
    """Training FLOPs per token (forward + backward + loss) of the baseline decoder of this shape: Lightning's
    measure_flops on the meta device (no memory, no compute), and the PaLM estimate SpeedMonitor logs with
    (6 x matmul parameters, LM head included, + 12 L H d T). The two agree to 1e-4 at the paper's sizes."""
    import torch
    import torch.nn.functional as F
    from lightning.fabric.utilities.throughput import measure_flops

    from mhar_lit import DecoderLM, ModelConfig
    from mhar_lit.residual import StandardResidual

    cfg = ModelConfig.from_name(size, **(overrides or {}))
    with torch.device("meta"):
        model = DecoderLM(cfg, StandardResidual())
        tokens = torch.zeros(1, seq_len, dtype=torch.long)
    loss = lambda logits: F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())  # noqa: E731
    measured = measure_flops(model, lambda: model(tokens), loss) / seq_len
    matmul_params = model.num_parameters(non_embedding=True) + cfg.vocab_size * cfg.hidden_size
    estimate = 6.0 * matmul_params + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return measured, estimate


def label_shape(config: dict, env: dict) -> dict[str, Any]:
    trainer, data, model = config["trainer"], config["data"], config["model"]
    world = world_size(trainer)
    accumulate = trainer.get("accumulate_grad_batches") or 1
    overrides = model.get("model_overrides")
    shape = {"micro_batch": data["batch_size"], "seq_len": data["seq_len"], "accumulate_grad_batches": accumulate,
             "world_size": world, "precision": trainer.get("precision"), "model_size": model["size"],
             "model_overrides": overrides, "residual": (model.get("residual") or {}).get("class_path"),
             "cuda_graph": model.get("cuda_graph"), "compile": model.get("compile"),
             "fused_loss": model.get("fused_loss")}
    shape["tokens_per_step"] = data["batch_size"] * data["seq_len"] * accumulate * world if world else None
    shape["flops_per_token"], shape["flops_per_token_6n"] = flops_per_token(model["size"], overrides, data["seq_len"])
    lightning_peak = env.get("peak_flops_lightning", {}).get(_dtype_name(trainer.get("precision")))
    config_peak = (config.get("speed") or {}).get("peak_tflops")
    if lightning_peak:
        shape["peak_flops"], shape["peak_flops_source"] = lightning_peak, "lightning get_available_flops"
    elif config_peak and env.get("cuda"):
        shape["peak_flops"], shape["peak_flops_source"] = config_peak * 1e12, "config speed.peak_tflops"
    else:
        shape["peak_flops"], shape["peak_flops_source"] = None, "none known for this device"
    shape["peak_flops_lightning"] = lightning_peak
    if shape["peak_flops"] and world:
        shape["peak_flops"] *= world  # tokens/s is the whole job's
    return shape


def _dtype_name(precision: Any) -> str:
    text = str(precision)
    return "bfloat16" if text.startswith("bf16") else "float16" if text.startswith("16") else "float32"


ENV_PROBE = r"""
import json, platform, sys, torch, lightning
from lightning.fabric.utilities.throughput import get_available_flops
info = {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": lightning.__version__,
        "cuda": torch.cuda.is_available(), "host": platform.node()}
try:
    import triton; info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
device = torch.device("cuda:0" if info["cuda"] else "cpu")
info["device"] = torch.cuda.get_device_name(device) if info["cuda"] else (platform.processor() or "cpu")
info["peak_flops_lightning"] = {str(d).replace("torch.", ""): get_available_flops(device, d)
                                for d in (torch.bfloat16, torch.float16, torch.float32)}
print("ENV " + json.dumps(info))
"""


def probe_environment() -> dict:
    """Device and versions from a short subprocess: this process never creates a CUDA context of its own."""
    done = subprocess.run([sys.executable, "-c", ENV_PROBE], capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ENV ")), None)
    if line is None:
        raise SystemExit(f"environment probe failed:\n{done.stderr[-2000:]}")
    return json.loads(line[4:])


def source_digest() -> str:
    """sha256 over the package, the configs and this script (paths and contents): compare it with the digest of
    a checkout (`--digest`) to know which code a run on a copied tree measured."""
    h = hashlib.sha256()
    files = sorted(p for d in ("mhar_lit", "configs") for p in (ROOT / d).rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts and p.suffix in (".py", ".yaml"))
    for path in files + [Path(__file__).resolve()]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------ the report

def spread(values: list[float]) -> Optional[dict[str, Any]]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "repeats": values}


def aggregate(labels: list[dict], fits: list[dict]) -> dict[str, dict]:
    """Per label: median / min / max over its repeats; ratios against the baseline of its group (the group's
    "baseline" method, else its first label): of the medians, and the median of the per-repeat ratios (each
    repeat's fits ran next to each other)."""
    ok = lambda f: "error" not in f  # noqa: E731
    table = {}
    for label in labels:
        mine = [f for f in fits if f["label"] == label["name"] and ok(f)]
        table[label["name"]] = {
            "size": label["size"], "method": label["method"], "variant": label.get("variant", ""), "config": label["config"],
            "fits_ok": len(mine), "fits_failed": sum(1 for f in fits if f["label"] == label["name"] and not ok(f)),
            **{key: spread([f.get(key) for f in mine])
               for key in ("tokens_per_s", "step_ms", "mfu", "run_logged_mfu", "peak_mem_gib")},
        }
    for label in labels:
        base = baseline_of(label, labels)
        row, base_row = table[label["name"]], table[base["name"]]
        row["baseline"] = base["name"]
        for key in ("tokens_per_s", "peak_mem_gib"):
            if row[key] and base_row[key]:
                row[f"{key}_vs_baseline"] = row[key]["median"] / base_row[key]["median"]
                paired = paired_ratios(fits, label["name"], base["name"], key)
                row[f"{key}_vs_baseline_paired"] = spread(paired)
        reference = reference_of(label, labels)
        if reference is not None:
            row["reference_variant"] = reference["name"]
            for key in ("tokens_per_s", "peak_mem_gib"):
                if row[key] and table[reference["name"]][key]:
                    row[f"{key}_vs_reference_variant"] = row[key]["median"] / table[reference["name"]][key]["median"]
    return table


def baseline_of(label: dict, labels: list[dict]) -> dict:
    """The group's "baseline" method in the same variant, else the group's first label of that variant."""
    group = [x for x in labels if x["group"] == label["group"] and x.get("variant") == label.get("variant")]
    return next((x for x in group if x["method"] == "baseline"), group[0])


def reference_of(label: dict, labels: list[dict]) -> Optional[dict]:
    """The same size and method in the first variant, for a label of another variant."""
    first = labels[0].get("variant", "")
    if label.get("variant", "") == first:
        return None
    return next((x for x in labels if x["group"] == label["group"] and x["method"] == label["method"]
                 and x.get("variant", "") == first), None)


def method_key(label: dict) -> str:
    return label["method"] + (f"+{label['variant']}" if label.get("variant") else "")


def issue_summary(labels: list[dict], table: dict[str, dict]) -> dict[str, dict]:
    """summary[size][method] of the medians: tokens_per_s, mfu, ratio_vs_baseline, peak_mem_ratio (+ the ratio
    against the first variant for the other variants)."""
    median = lambda x: x["median"] if x else None  # noqa: E731
    first = labels[0].get("variant", "") if labels else ""
    summary: dict[str, dict] = {}
    for label in labels:
        row = table[label["name"]]
        entry = {"tokens_per_s": median(row["tokens_per_s"]), "mfu": median(row["mfu"]),
                 "ratio_vs_baseline": row.get("tokens_per_s_vs_baseline"),
                 "peak_mem_ratio": row.get("peak_mem_gib_vs_baseline"), "fits_ok": row["fits_ok"]}
        if label.get("variant", "") != first:
            entry[f"ratio_vs_{first}"] = row.get("tokens_per_s_vs_reference_variant")
            entry[f"peak_mem_ratio_vs_{first}"] = row.get("peak_mem_gib_vs_reference_variant")
        summary.setdefault(label["size"], {})[method_key(label)] = entry
    return summary


PEER_VARIANTS = ("litgpt_compile", "litgpt")  # litgpt's pretrain compiles its model: that step first


def add_peer(summary: dict[str, dict], peer: dict) -> None:
    """summary[size]["litgpt"] from a benchmarks/peer_step.py report, against our baseline's fit at that size."""
    for result in peer["sizes"]:
        found = next((v for v in PEER_VARIANTS if v in result["variants"]), None)
        if found is None or result["size"] not in summary:
            continue
        row = result["variants"][found]
        ours = summary[result["size"]].get("baseline", {}).get("tokens_per_s")
        summary[result["size"]]["litgpt"] = {
            "tokens_per_s": row["tokens_per_s"], "mfu": row["mfu"],
            "ratio_vs_baseline": row["tokens_per_s"] / ours if ours else None, "peak_mem_ratio": None,
            "source": f"benchmarks/peer_step.py variant {found} ({peer.get('device')}, commit {peer.get('commit')})"}


def merge_reports(paths: list[str], peer_path: Optional[str]) -> dict:
    """One report from several of the same device and measured code (one size each): labels, fits, shapes,
    summary. Reports of different commits join only when their source digests (package, configs, this script)
    are equal: commits that changed other files measured the same code; `commits` lists them."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    code = "source_digest" if all(r.get("source_digest") for r in reports) else "commit"
    for key in ("device", code):
        values = {r.get(key) for r in reports}
        if len(values) > 1:
            raise SystemExit(f"--merge: the reports differ in {key}: {sorted(map(str, values))}")
    merged = {k: v for k, v in reports[0].items() if k not in ("fits", "shapes", "labels", "summary", "stopped")}
    merged.update(merged_from=paths, commits=sorted({str(r.get("commit")) for r in reports}), fits=[], shapes={},
                  labels={}, summary={}, stopped=[r["stopped"] for r in reports if r.get("stopped")])
    for report in reports:
        twice = set(report["labels"]) & set(merged["labels"])
        if twice:
            raise SystemExit(f"--merge: labels {sorted(twice)} are in more than one report")
        merged["fits"] += report["fits"]
        merged["shapes"].update(report["shapes"])
        merged["labels"].update(report["labels"])
        for size, methods in report["summary"].items():
            merged["summary"].setdefault(size, {}).update(methods)
    if peer_path:
        peer = json.loads(Path(peer_path).read_text())
        if peer.get("device") != merged.get("device"):
            raise SystemExit(f"--peer: {peer_path} ran on {peer.get('device')}, the fits on {merged.get('device')}")
        add_peer(merged["summary"], peer)
    return merged


def paired_ratios(fits: list[dict], name: str, base: str, key: str) -> list[float]:
    by_repeat = lambda n: {f["repeat"]: f.get(key) for f in fits if f["label"] == n and "error" not in f}  # noqa: E731
    mine, theirs = by_repeat(name), by_repeat(base)
    return [mine[r] / theirs[r] for r in sorted(mine) if mine[r] and theirs.get(r)]


def table_text(summary: dict[str, dict]) -> str:
    """The per-label table (report["labels"])."""
    def num(x, fmt):
        return format(x, fmt) if x is not None else "-"

    lines = [f"{'label':18s} {'tokens/s median [min, max]':>32s} {'vs base':>8s} {'paired':>7s} {'step ms':>8s} "
             f"{'MFU':>6s} {'peak GiB':>9s} {'vs base':>8s} {'fits':>5s}"]
    for name, row in summary.items():
        tps, mem, step, mfu = row["tokens_per_s"], row["peak_mem_gib"], row["step_ms"], row["mfu"]
        paired = row.get("tokens_per_s_vs_baseline_paired")
        speed = f"{tps['median']:,.0f} [{tps['min']:,.0f}, {tps['max']:,.0f}]" if tps else "-"
        lines.append(
            f"{name:18s} {speed:>32s} {num(row.get('tokens_per_s_vs_baseline'), '.4f'):>8s} "
            f"{num(paired and paired['median'], '.4f'):>7s} {num(step and step['median'], '.1f'):>8s} "
            f"{num(mfu and mfu['median'], '.3f'):>6s} {num(mem and mem['median'], '.2f'):>9s} "
            f"{num(row.get('peak_mem_gib_vs_baseline'), '.4f'):>8s} {row['fits_ok']:>2d}/{row['fits_ok'] + row['fits_failed']}")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line

def parse_variants(items: Optional[list[str]]) -> list[tuple[str, str, list[str]]]:
    """(name, label suffix, CLI overrides) of every --variants NAME=OVERRIDES; one unnamed variant without."""
    if not items:
        return [("", "", [])]
    variants = []
    for item in items:
        name, sep, overrides = item.partition("=")
        if not sep or not name or "/" in name:
            raise SystemExit(f"--variants takes NAME=OVERRIDES (the overrides may be empty), got {item!r}")
        variants.append((name, f"+{name}", shlex.split(overrides)))
    if len({v[0] for v in variants}) < len(variants):
        raise SystemExit(f"--variants: a name is given twice in {items}")
    return variants


def parse_labels(args) -> list[dict]:
    """The (size, variant, method) matrix of shipped configs, or the --configs LABEL=PATH list that replaces the
    (size, method) part."""
    variants = parse_variants(args.variants)
    if args.configs:
        labels = []
        for item in args.configs:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--configs takes LABEL=PATH, got {item!r}")
            labels += [{"name": name + suffix, "size": name, "method": name, "group": "configs", "config": [path],
                        "variant": variant, "overrides": overrides} for variant, suffix, overrides in variants]
    else:
        unknown = sorted(set(args.methods) - set(METHOD_FILES))
        if unknown:
            raise SystemExit(f"unknown methods {unknown}; choose from {sorted(METHOD_FILES)}")
        labels = [{"name": f"{size}/{method}{suffix}", "size": size, "method": method, "group": size,
                   "config": [f"configs/paper/{size}.yaml", f"configs/methods/{METHOD_FILES[method]}"],
                   "variant": variant, "overrides": overrides}
                  for size in args.sizes for variant, suffix, overrides in variants for method in args.methods]
    for label in labels:
        for config in label["config"]:
            if not (ROOT / config).is_file():
                raise SystemExit(f"{label['name']}: config {config} not found (paths are relative to {ROOT})")
    return labels


def fit_order(labels: list[dict], repeats: int) -> list[tuple[dict, int]]:
    """Group by group (size), then repeats, then methods: baseline, mhar, block, baseline, mhar, block, ..."""
    groups = list(dict.fromkeys(label["group"] for label in labels))
    return [(label, r) for g in groups for r in range(repeats) for label in labels if label["group"] == g]


def parse_args(argv: Optional[list[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES))
    p.add_argument("--methods", nargs="+", default=list(METHOD_FILES))
    p.add_argument("--configs", nargs="+", metavar="LABEL=PATH", help="configs to time instead of the shipped matrix")
    p.add_argument("--variants", nargs="+", metavar="NAME=OVERRIDES",
                   help="time every config under each of these CLI overrides (see the module docstring)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-steps", type=int, help=f"trainer.max_steps of every fit (default per size: {DEFAULT_MAX_STEPS}, "
                                                 f"else {FALLBACK_MAX_STEPS})")
    p.add_argument("--warmup", type=int, default=3, help="logged steps after SpeedMonitor's skip_steps left out "
                                                          "(>= 1: an accumulating run's window at skip_steps is partial)")
    p.add_argument("--extra", default="", help='CLI overrides appended to every fit, e.g. "--model.cuda_graph true"')
    p.add_argument("--keep-data", action="store_true", help="read the configs' own corpus and tokenizer")
    p.add_argument("--out", default="benchmarks/results/fit_throughput.json")
    p.add_argument("--merge", nargs="+", metavar="REPORT", help="join these reports (one device) into --out and exit")
    p.add_argument("--peer", help="a benchmarks/peer_step.py report: litgpt's step as summary[size]['litgpt']")
    p.add_argument("--workdir", help="where the fits' stores, logs and the shared data cache go (default: a temp dir)")
    p.add_argument("--fit-timeout", type=float, default=900.0, help="seconds before one fit is stopped")
    p.add_argument("--time-budget", type=float, help="seconds for this script: no fit is started that would likely end "
                                                     "after it (judged by earlier fits); the report says so")
    p.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes (recorded)")
    p.add_argument("--commit", help="the commit of a tree copied without its git history (recorded as stated)")
    p.add_argument("--dry-run", action="store_true", help="print the fit commands and exit")
    p.add_argument("--digest", action="store_true", help="print the source digest of this checkout and exit")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1 or (args.max_steps is not None and args.max_steps < 1):
        p.error("--repeats >= 1, --warmup >= 1 and --max-steps >= 1 are required")
    args.extra = shlex.split(args.extra)
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    start = time.time()
    args = parse_args(argv)
    if args.digest:
        print(source_digest())
        return {}
    if args.merge:
        report = merge_reports(args.merge, args.peer)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"{len(args.merge)} reports -> {args.out}")
        print(table_text(report["labels"]))
        return report
    labels = parse_labels(args)
    if args.workdir:
        work_root = Path(args.workdir).resolve()
    else:
        work_root = Path(tempfile.gettempdir(), "fit_throughput_TMP") if args.dry_run else \
            Path(tempfile.mkdtemp(prefix="fit_throughput_"))
    order = fit_order(labels, args.repeats)
    if args.dry_run:
        for label, repeat in order:
            work = work_root / f"{label['name'].replace('/', '_')}_r{repeat}"
            cmd = fit_command(label["config"], max_steps_for(label["size"], args.max_steps), work,
                              work_root / "data_cache", args.keep_data, args.extra + label["overrides"])
            print(shlex.join(cmd))
        return {}
    git = git_state(args.commit)
    if git["clean"] is False and not args.allow_dirty:
        raise SystemExit("the tree has uncommitted changes (pass --allow-dirty to measure it anyway):\n  "
                         + "\n  ".join(git["dirty_files"]))
    env = probe_environment()
    report = {"command": shlex.join([sys.executable] + sys.argv), "date": dt.datetime.now().isoformat(timespec="seconds"),
              **git, "allow_dirty": args.allow_dirty, "source_digest": source_digest(), **env,
              "settings": {"repeats": args.repeats, "warmup": args.warmup, "skip_steps": SKIP_STEPS,
                           "max_steps": {lb["name"]: max_steps_for(lb["size"], args.max_steps) for lb in labels},
                           "extra": args.extra, "keep_data": args.keep_data, "workdir": str(work_root),
                           "variants": {v: o for v, _, o in parse_variants(args.variants)}},
              "shapes": {}, "fits": [], "labels": {}, "summary": {}}
    with ThreadPoolExecutor(max_workers=4) as pool:  # one LightningCLI start each: run them side by side
        configs = list(pool.map(lambda label: resolved_config(label, args), labels))
    for label, config in zip(labels, configs):
        report["shapes"][label["name"]] = label_shape(config, env)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for label, repeat in order:
        if args.time_budget and time.time() - start + expected_wall(report["fits"], label) > args.time_budget:
            report["stopped"] = f"time budget of {args.time_budget:.0f} s: {label['name']} repeat {repeat} and later not run"
            print(report["stopped"], flush=True)
            break
        fit = run_fit(label, repeat, args, work_root, report["shapes"][label["name"]])
        report["fits"].append(fit)
        state = f"{fit['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in fit else f"FAILED ({fit.get('rc')})"
        print(f"{label['name']} repeat {repeat}: {state}, {fit['wall_s']} s", flush=True)
        report["labels"] = aggregate(labels, report["fits"])
        report["summary"] = issue_summary(labels, report["labels"])
        out.write_text(json.dumps(report, indent=1))
    if args.peer:
        add_peer(report["summary"], json.loads(Path(args.peer).read_text()))
    out.write_text(json.dumps(report, indent=1))
    print(f"\n{env['device']}, torch {env['torch']}, commit {git['commit']} (clean: {git['clean']}); {out}")
    print(table_text(report["labels"]))
    return report


if __name__ == "__main__":
    main()
