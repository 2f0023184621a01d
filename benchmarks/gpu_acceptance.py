"""The user's path on one GPU, with the shipped defaults (capture, Triton routing and its first-batch check on):
`fit` of every shipped method from the paper recipes, `generate` (and its greedy tokens on the GPU against the
CPU's, up to ties) and `export` on a checkpoint a fit wrote, the exported directory in transformers, captured against eager
training under gradient accumulation, and the GPU test files. Run by benchmarks/gpu_acceptance.sh; writes
benchmarks/results/gpu_acceptance.json (or --out): `commit`, `device`, `date`, `cases` ([{"name", "passed",
"detail", "seconds"}]) and `passed`.

Time: on an H100 the whole run took 430 s in one call at f0043be (2026-12-07), with the cases after the first
fit two at a time and the routing matrix (one process on an 80 GB card) the longest case at 430 s; 500 s before,
with the cases one at a time. On a card with over 100 GiB the matrix splits by dtype (not yet timed). The
matrix's small-model shape (heads 4 to 64 wide) runs as a group of its own, beside it (not yet timed).
Resuming: every call also keeps its report in --work; a later call on the same warm machine, at the same commit
and device, carries over the cases that passed there (marked `carried_from`, the earlier call's date) and runs the
rest, so two calls under the limit give one complete report.

Stated reductions, for the 10-minute budget: each fit runs 2 optimizer steps with the recipe's own microbatch,
sequence length and accumulation; the corpus is the embedded standard-library source at byte level (the recipes'
corpus paths are placeholders; the model keeps the paper's vocabulary).
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["baseline", "hc", "single-head", "mhar", "block-mhar"]
ROUTED = {"single-head", "mhar", "block-mhar"}
DATA = ["--data.data", "null", "--data.tokenizer", "bytes", "--data.max_corpus_bytes", "3000000",
        "--data.num_workers", "2", "--data.cache_dir", "{work}/data_cache"]


class Acceptance:
    """The cases so far. The report is rewritten after every case, to --out and (when the device call sets it)
    to $OUT: a run killed at the call's limit still returns what it answered, marked incomplete."""

    def __init__(self, work: str, budget_s: float, header: dict, paths: list[str]) -> None:
        self.work, self.t0, self.budget_s, self.cases = work, time.time(), budget_s, []
        kept = f"{work}/acceptance.json"  # what a later call on this machine carries over
        self.header, self.paths, self.lock = header, paths + [kept], threading.Lock()
        self.earlier = _earlier_passes(kept, header)
        self.store_template: str | None = None  # an MLflow store to copy for each fit (store_template)

    def carried(self, name: str) -> bool:
        """True (and the case taken into this report) if an earlier call at this commit and device passed it."""
        case = self.earlier.get(name)
        if case is None:
            return False
        with self.lock:
            self.cases.append(case)
        print(f"[{time.time() - self.t0:5.0f}s] PASS {name} (carried from {case['carried_from']})", flush=True)
        return True

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def add(self, name: str, passed: bool, detail: str, seconds: float) -> None:
        with self.lock:
            short = detail if len(detail) <= 1500 else detail[:400] + "\n...\n" + detail[-1100:]
            self.cases.append({"name": name, "passed": bool(passed), "detail": short,
                               "seconds": round(seconds, 1)})
            self.write(complete=False)
        print(f"[{time.time() - self.t0:5.0f}s] {'PASS' if passed else 'FAIL'} {name} ({seconds:.0f}s)", flush=True)

    def write(self, complete: bool) -> dict:
        report = {**self.header, "seconds": round(time.time() - self.t0), "complete": complete, "cases": self.cases,
                  "passed": complete and bool(self.cases) and all(c["passed"] for c in self.cases)}
        for path in self.paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as fh:
                json.dump(report, fh, indent=1)
            os.replace(path + ".tmp", path)
        return report

    def run(self, cmd: list[str], timeout: float, log: str, env: dict | None = None) -> tuple[int, str, float]:
        start = time.time()
        if self.left() < 10:
            return 124, "not run: the budget (--budget-s) was spent", 0.0
        timeout = max(5.0, min(timeout, self.left()))
        with open(log, "w") as fh:
            rc = _run_logged(cmd, fh, timeout, {**os.environ, **(env or {})})
        return rc, open(log, errors="replace").read(), time.time() - start


TIME_PREFIX = re.compile(r"^\[\s*[0-9.]+s\] ")


def _run_logged(cmd: list[str], fh, timeout: float, env: dict) -> int:
    """Runs cmd with every output line written to fh behind its time since the start (`[  12.3s] `), so that a
    log shows where a case's seconds went; 124 if it passes timeout (the process is killed)."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, errors="replace", bufsize=1)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            fh.write(f"[{time.time() - start:6.1f}s] {line}")
        rc = proc.wait()
    finally:
        killer.cancel()
    return 124 if rc < 0 and time.time() - start >= timeout else rc


def _earlier_passes(path: str, header: dict) -> dict:
    """The cases an earlier call of this work folder passed at the same commit, device and torch, by name."""
    try:
        with open(path) as fh:
            earlier = json.load(fh)
    except (OSError, ValueError):
        return {}
    if any(earlier.get(key) != header[key] for key in ("commit", "device", "torch")) or header["commit"] == "unknown":
        return {}
    return {c["name"]: {**c, "carried_from": c.get("carried_from", earlier["date"])}
            for c in earlier.get("cases", []) if c["passed"]}


def fit_store(work: str, size: str, method: str) -> str:
    """The fit's own MLflow store (sqlite file)."""
    return f"{work}/{size}-{method}.db"


def fit_command(work: str, size: str, method: str, steps: int) -> list[str]:
    name = f"{size}-{method}"
    return [sys.executable, "-m", "mhar_lit", "fit", "--config", f"configs/paper/{size}.yaml",
            "--config", f"configs/methods/{method}.yaml",
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
            "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--checkpoint.every_n_train_steps", str(steps),
            "--trainer.default_root_dir", f"{work}/{name}",
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{fit_store(work, size, method)}",
            *[a.format(work=work) for a in DATA]]


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text.replace(",", "")))
    except ValueError:
        return False


def store_template(work: str) -> str | None:
    """An empty MLflow store whose tables are made once, copied for every fit: each fit creating its own ran the
    schema's migrations, ~9 s of every fit's log (H100, 2026-12-07). None if it could not be made (each fit then
    makes its own store, as before)."""
    path = f"{work}/store_template.db"
    if not os.path.exists(path):
        make = "import sys, mlflow; mlflow.MlflowClient(tracking_uri='sqlite:///' + sys.argv[1]).search_experiments()"
        done = subprocess.run([sys.executable, "-c", make, path + ".tmp"], capture_output=True, timeout=120)
        if done.returncode != 0:
            return None
        os.replace(path + ".tmp", path)
    return path


def fit_case(acc: Acceptance, size: str, method: str, steps: int = 2) -> None:
    name = f"fit {size} {method}"
    if acc.carried(name):
        return
    store = fit_store(acc.work, size, method)
    if acc.store_template and not os.path.exists(store):
        shutil.copyfile(acc.store_template, store)
    rc, log, secs = acc.run(fit_command(acc.work, size, method, steps), 240, f"{acc.work}/{size}-{method}.log")
    problems = [] if rc == 0 else [f"exit {rc}"]
    if "training steps: captured (CUDA graphs)" not in log:
        problems.append("did not train on the captured path")
    if method in ROUTED and "depth routing backend: triton" not in log:
        problems.append("routing did not run on triton")
    if method in ROUTED and "routing differs" in log:
        problems.append("first-batch router check failed")
    losses = re.findall(r"train/loss (\S+)", log)  # the fit's closing summary
    if not losses or not _finite(losses[-1]):
        problems.append(f"final train/loss {losses[-1] if losses else 'not printed'}")
    detail = "; ".join(problems) if problems else (
        "captured path" + (", Triton routing, first-batch check passed" if method in ROUTED else ""))
    tail = "\n".join(log.strip().splitlines()[-8:]) if problems else ""
    acc.add(name, not problems, detail + ("\n" + tail if tail else ""), secs)


def generate_and_export(acc: Acceptance) -> None:
    if {"generate", "export + transformers"} <= acc.earlier.keys():  # both passed earlier, else both run again
        acc.carried("generate"), acc.carried("export + transformers")
        return
    ckpts = sorted(glob.glob(f"{acc.work}/100M-mhar/**/last.ckpt", recursive=True))
    if not ckpts:
        acc.add("generate", False, "no checkpoint from fit 100M mhar", 0)
        acc.add("export + transformers", False, "no checkpoint from fit 100M mhar", 0)
        return
    rc, log, secs = acc.run([sys.executable, "-m", "mhar_lit", "generate", "--ckpt", ckpts[0], "--prompt", "def ",
                             "--max_new_tokens", "24"], 120, f"{acc.work}/generate.log")
    if rc != 0:
        acc.add("generate", False, f"exit {rc}: " + log.strip()[-300:], secs)
    else:  # the command ran; now its tokens: the GPU's against the CPU's
        rc, log, secs2 = acc.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_acceptance.py"),
                                  "--check-generate", ckpts[0]], 180, f"{acc.work}/generate_tokens.log")
        acc.add("generate", rc == 0, log.strip()[-500:], secs + secs2)
    out = f"{acc.work}/exported"
    rc, log, secs = acc.run([sys.executable, "-m", "mhar_lit", "export", "--ckpt", ckpts[0], "--to", out,
                             "--dtype", "float32"], 120, f"{acc.work}/export.log")
    if rc != 0:
        acc.add("export + transformers", False, f"export exit {rc}: " + log.strip()[-500:], secs)
        return
    rc, log, secs2 = acc.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_acceptance.py"),
                              "--compare-exported", out], 120, f"{acc.work}/compare.log")
    acc.add("export + transformers", rc == 0, log.strip()[-500:], secs + secs2)


GREEDY_TIE = 1e-4  # logit gap (fp32) under which two tokens are a tie that rounding may break either way


def greedy_gaps(model, prompts: list[list[int]], rows: list[list[int]]) -> list[float]:
    """Per row, the largest gap max(logits) - logits[token] over its generated tokens, from the model's full forward
    (no cache) of the prompt and the tokens before each: 0 where every token is the forward's greedy choice."""
    import torch

    gaps = []
    for prompt, tokens in zip(prompts, rows):
        if not tokens:
            gaps.append(0.0)
            continue
        ids = torch.tensor([prompt + tokens[:-1]], device=next(model.parameters()).device)
        with torch.no_grad():
            logits = model(ids)[0, len(prompt) - 1:].double()
        chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        gaps.append((logits.max(1).values - chosen).max().item())
    return gaps


def check_generate(ckpt: str) -> None:
    """generate's greedy token ids on the GPU against the CPU's, fp32, for a left-padded batch of two prompts, with
    the CUDA default loop (a captured decode step, the decode kernels) against the CPU's eager loop. Token ids, not
    text: the fits' briefly trained models pick ids that the byte tokenizer decodes to nothing. Equal ids pass;
    where they differ, the GPU's tokens must still be greedy for the CPU's full forward up to ties (GREEDY_TIE: a
    near-tie that fp32 rounding breaks the other way, after which the two continuations part), so that a briefly
    trained model's flat logits are no false alarm while a wrong token is still one."""
    import torch

    from mhar_lit.generation import generate
    from mhar_lit.generation.loading import load_generator

    tokens, models = {}, {}
    for device in ("cuda", "cpu"):
        loaded = load_generator(ckpt, None, None, torch.device(device), torch.float32)
        prompts = [loaded.encode("def "), loaded.encode("import numpy as np\n\nclass ")]
        tokens[device], models[device] = generate(loaded.model, prompts, 24), loaded.model
        print(f"{device}: {tokens[device]}")
    if tokens["cuda"] == tokens["cpu"]:
        print("generate, fp32, a batch of 2 left-padded prompts, 24 new tokens: the GPU's tokens equal the CPU's")
        sys.exit(0)
    gaps = greedy_gaps(models["cpu"], prompts, tokens["cuda"])
    ok = max(gaps) <= GREEDY_TIE
    print(f"generate, fp32: the GPU's tokens differ from the CPU's; their largest gap to the CPU forward's greedy "
          f"logit is {max(gaps):.2e} (a tie up to {GREEDY_TIE:.0e}): {'ties only' if ok else 'a wrong token'}")
    sys.exit(0 if ok else 1)


def compare_exported(directory: str) -> None:
    """Logits of the exported directory through transformers (remote code) against mhar_lit's loader, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    import mhar_lit

    ours = mhar_lit.load_pretrained(directory).cuda().eval()
    theirs = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, torch_dtype=torch.float32)
    theirs = theirs.cuda().eval()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        a, b = ours(ids).float(), theirs(ids).logits.float()
    rel = ((a - b).abs().max() / a.abs().max()).item()
    print(f"transformers vs mhar_lit logits, fp32: max relative difference {rel:.2e} (bound 1e-4)")
    sys.exit(0 if rel <= 1e-4 else 1)


def graph_checks(acc: Acceptance) -> None:
    # 100M with the recipes' fused loss and fused ops: the path users train on (and 7 instead of ~40 GiB beside
    # the other cases)
    for size, precision, accumulate, loss in (("demo", "32-true", 4, []),
                                              ("100M", "bf16-true", 4, ["--fused-loss", "--fused-ops"])):
        if acc.carried(f"captured = eager, accumulate {accumulate}, {size} {precision}"):
            continue
        out = f"{acc.work}/graph_{size}.json"
        rc, log, secs = acc.run([sys.executable, "benchmarks/graph_fit_check.py", "--size", size, "--precision",
                                 precision, "--accumulate", str(accumulate), "--steps", "3", *loss, "--out", out],
                                200, f"{acc.work}/graph_{size}.log")
        table = log.strip().splitlines()[-3:]
        acc.add(f"captured = eager, accumulate {accumulate}, {size} {precision}", rc == 0, "\n".join(table), secs)


def gpu_test_groups(memory_gib: float) -> dict[str, tuple[list[str], dict]]:
    """The GPU test files as groups, each run in a pytest process of its own beside the fits and the other groups.
    With over 100 GiB the routing matrix runs as two processes by dtype: it is bound by Triton's compiles (each
    dtype its own kernels), and whole it was the run's longest case (430 s on an H100, 2026-12-07); on an 80 GB
    card it stays one process, as two would hold two sets of float64 references (~25 GiB each at the 8B shape)
    beside the fits."""
    matrix, env = ["tests/test_gpu_routing_matrix.py"], {"TRITON_INTERPRET": "0"}
    groups = ({"tests: GPU routing matrix": (matrix + ["-k", "not narrow"], env)} if memory_gib <= 100 else
              {f"tests: GPU routing matrix {dtype}": (matrix + ["-k", f"{dtype} and not narrow"], env)
               for dtype in ("fp32", "bf16")})
    # a small model's shape (heads down to 4 wide, 15 tokens): kernels of their own to compile, little memory, so a
    # process of its own rather than more time on the matrix's longest path
    groups["tests: GPU routing matrix, small model"] = (matrix + ["-k", "narrow"], env)
    groups["tests: CUDA graph and generation"] = (["tests/test_cuda_graph.py", "tests/test_generation.py",
                                                   "tests/test_decode_paths.py", "tests/test_routing_backend.py"], {})
    # the group above runs under Triton's interpreter (tests/conftest.py's default), where generate keeps the plain
    # ops: liger's kernels in training and decoding, and generate on CUDA, compiled as users run them
    groups["tests: compiled fused ops and generation"] = (
        ["tests/test_fused_ops_gpu.py", "tests/test_decode_paths.py", "-k", "cuda or fused"], env)
    return groups


def gpu_tests(acc: Acceptance, name: str, files: list[str], env: dict) -> None:
    if acc.carried(name):
        return
    # no cap of its own but the budget: beside the fits, the routing matrix was 89% done at 300 s (H100, 2026-12-07)
    rc, log, secs = acc.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=30",
                             *files], 600,
                            f"{acc.work}/{name.split(':')[1].strip().replace(' ', '_')}.log", env)
    lines = [TIME_PREFIX.sub("", line) for line in log.strip().splitlines()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    acc.add(name, rc == 0, "\n".join(failed + lines[-1:]), secs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_acceptance.json"))
    parser.add_argument("--work", default="/tmp/gpu_acceptance")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--parallel", type=int, default=2,
                        help="cases run at once on the GPU after the first fit (beside the test groups)")
    parser.add_argument("--compare-exported", help=argparse.SUPPRESS)
    parser.add_argument("--check-generate", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare_exported:
        return compare_exported(args.compare_exported)
    if args.check_generate:
        return check_generate(args.check_generate)
    os.makedirs(args.work, exist_ok=True)
    import torch

    header = {"commit": args.commit, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": dt.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    paths = [args.out] + ([os.path.join(os.environ["OUT"], "gpu_acceptance.json")] if os.environ.get("OUT") else [])
    acc = Acceptance(args.work, args.budget_s, header, paths)
    # the test groups are compile-bound (CPU, 16 cores there): each in a thread of its own, beside the fits (one
    # after the other they took 278 + 104 s of a 415 s run on an H100, the longest path of the run)
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    tests = [ThreadPoolExecutor(1).submit(gpu_tests, acc, name, *group)
             for name, group in gpu_test_groups(memory_gib).items()]
    # The first fit writes the corpus cache the others read; then `parallel` cases at once (one after the other
    # they were the run's longest path, 500 s of 500 on an H100, 2026-12-07): with the recipes' fused loss a fit
    # holds 7-9 GiB at 100M / 350M where the plain loss held up to 46 (H200, 2026-12-06), so two fit beside the
    # routing matrix's float64 references (~25 GiB at the 8B shape) on an 80 GB card. The cases that failed
    # before come first (so that a short budget still answers them): MHAR's first-batch check with generate and
    # export on its checkpoint, capture under accumulation; then the other methods and sizes, interleaved so that
    # fits running at once are not all of the largest microbatch.
    acc.store_template = store_template(args.work)
    fit_case(acc, "100M", "baseline")
    plan = [("1B", "mhar"), ("100M", "single-head"), ("350M", "baseline"), ("100M", "block-mhar"),
            ("1B", "baseline"), ("100M", "hc"), ("350M", "mhar")]
    jobs = [lambda: (fit_case(acc, "100M", "mhar"), generate_and_export(acc)), lambda: graph_checks(acc),
            *[lambda sm=sm: fit_case(acc, *sm) for sm in plan]]
    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda job: job(), jobs))
    for group in tests:
        group.result()

    report = acc.write(complete=True)
    print(f"\n{'case':<48} {'passed':<7} seconds")
    for c in acc.cases:
        print(f"{c['name']:<48} {str(c['passed']):<7} {c['seconds']}")
    print(f"all passed: {report['passed']}")


if __name__ == "__main__":
    main()
