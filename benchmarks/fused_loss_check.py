"""The fused LM head + cross-entropy (model.fused_loss) against the plain loss on the GPU, at the shipped shapes.

    python benchmarks/fused_loss_check.py [--sizes 100M 350M 1B] [--iters 10] [--time-budget 120] [--out F.json]
    python benchmarks/fused_loss_check.py --device cpu --sizes tiny --iters 1     (a CPU check, Triton's interpreter)

Per size (the LM head of configs/paper/SIZE.yaml: d, vocabulary 151,936, micro-batch x sequence tokens
of hidden states) and per precision, "bf16-true" (bf16 weight) and "bf16-mixed" (fp32 weight under bf16
autocast), with z-loss 1e-4:
- numerics: loss and the gradients of the hidden states and of the weight, fused against plain (relative to
  the largest plain value). This runs the compiled Triton kernel and the CUDA-only fp32-accumulating addmm,
  which the CPU tests cannot reach;
- capture: the fused loss inside torch.cuda.make_graphed_callables (no host sync may remain), replayed on new
  data, against the eager fused loss (differences, expected 0);
- time and memory: forward + backward of the loss alone, median over --iters (CUDA events), and the peak memory
  above the inputs (max_memory_allocated).
Sizes past --time-budget seconds are skipped and reported so. JSON (device, versions) written after every size;
a table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mhar_lit import ModelConfig  # noqa: E402
from mhar_lit.kernels.linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402

Z_LOSS = 1e-4
PRECISIONS = ("bf16-true", "bf16-mixed")


def plain(hidden, weight, targets):
    logits = (hidden @ weight.t()).float()
    ce = F.cross_entropy(logits, targets)
    return ce, torch.logsumexp(logits, dim=-1).pow(2).mean()


def fused(hidden, weight, targets):
    return fused_linear_cross_entropy(hidden, weight, targets, Z_LOSS)


def shape_of(size: str) -> tuple[int, int, int]:
    """(tokens per micro-batch, d, vocabulary) of the shipped recipe (configs/paper/SIZE.yaml); tiny: a CPU check."""
    if size == "tiny":
        cfg = ModelConfig.from_name("tiny")
        return 64, cfg.hidden_size, cfg.vocab_size
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "paper" / f"{size}.yaml").read_text())
    cfg = ModelConfig.from_name(config["model"]["size"], **(config["model"].get("model_overrides") or {}))
    return config["data"]["batch_size"] * config["data"]["seq_len"], cfg.hidden_size, cfg.vocab_size


class _Loss(torch.nn.Module):
    """The weight as a parameter and the loss of (hidden, targets): the unit make_graphed_callables captures."""

    def __init__(self, weight: torch.Tensor, loss: Callable, precision: str) -> None:
        super().__init__()
        self.weight, self.loss, self.precision = torch.nn.Parameter(weight), loss, precision

    def forward(self, hidden, targets):
        with autocast_for(self.precision, hidden.device):
            ce, z = self.loss(hidden, self.weight, targets)
        return ce + Z_LOSS * z


def autocast_for(precision: str, device: torch.device):
    enabled = precision == "bf16-mixed"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=False)


def inputs(tokens: int, d: int, vocab: int, precision: str, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    hidden = torch.randn(tokens, d, generator=g).to(device, dtype).requires_grad_()
    weight = (0.02 * torch.randn(vocab, d, generator=g)).to(device, dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return hidden, weight, targets


def loss_and_grads(module: Callable, params: list, hidden, targets):
    hidden.grad = None
    for p in params:
        p.grad = None
    loss = module(hidden, targets)
    loss.backward()
    return [loss.detach().float()] + [t.grad.detach().float() for t in [hidden, *params]]


def relative_errors(ours: list, reference: list) -> dict[str, float]:
    names = ("loss", "d_hidden", "d_weight")
    return {n: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for n, a, b in zip(names, ours, reference)}


def timed(fn: Callable, iters: int, device: torch.device) -> tuple[float, Optional[float]]:
    """Median ms of fn() and the peak memory (GiB) above what was allocated before."""
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            fn()
            times.append(1e3 * (time.perf_counter() - start))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def check(size: str, precision: str, iters: int, device: torch.device) -> dict[str, Any]:
    tokens, d, vocab = shape_of(size)
    hidden, weight, targets = inputs(tokens, d, vocab, precision, device, seed=0)
    row: dict[str, Any] = {"tokens": tokens, "d": d, "vocab": vocab}
    modules = {name: _Loss(weight.clone(), loss, precision) for name, loss in (("plain", plain), ("fused", fused))}
    results = {n: loss_and_grads(m, [m.weight], hidden, targets) for n, m in modules.items()}
    row["fused_vs_plain"] = relative_errors(results["fused"], results["plain"])
    if device.type == "cuda":
        row["captured_vs_eager"] = captured_vs_eager(weight, tokens, d, vocab, precision, device)
    for name, module in modules.items():
        ms, peak = timed(lambda: loss_and_grads(module, [module.weight], hidden, targets), iters, device)
        row[f"{name}_ms"], row[f"{name}_peak_gib"] = ms, peak
    row["speedup"] = row["plain_ms"] / row["fused_ms"]
    return row


def captured_vs_eager(weight: torch.Tensor, tokens: int, d: int, vocab: int, precision: str,
                      device: torch.device) -> dict[str, float]:
    """The fused loss captured (make_graphed_callables replaces the module's forward), replayed on other data than
    the sample, against a copy of it run eagerly."""
    captured, eager = (_Loss(weight.clone(), fused, precision) for _ in range(2))
    sample = inputs(tokens, d, vocab, precision, device, seed=1)
    torch.cuda.make_graphed_callables(captured, (sample[0], sample[2]))
    hidden, _, targets = inputs(tokens, d, vocab, precision, device, seed=2)
    replay = loss_and_grads(captured, [captured.weight], hidden, targets)
    reference = loss_and_grads(eager, [eager.weight], hidden, targets)
    return relative_errors(replay, reference)


def environment(device: torch.device) -> dict[str, Any]:
    from importlib.metadata import version

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": version("triton"), "liger_kernel": version("liger-kernel"),
            "date": dt.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv), "z_loss": Z_LOSS}


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["100M", "350M", "1B"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--time-budget", type=float, default=120.0, help="seconds; later sizes are skipped")
    p.add_argument("--out", default="fused_loss_check.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu --sizes tiny for a check of the script")
    start, report = time.time(), {**environment(device), "results": {}, "skipped": []}
    for size in args.sizes:
        for precision in PRECISIONS:
            if time.time() - start > args.time_budget:
                report["skipped"].append(f"{size} {precision}")
                continue
            report["results"][f"{size} {precision}"] = check(size, precision, args.iters, device)
            Path(args.out).write_text(json.dumps(report, indent=1))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'shape':18s} {'plain ms':>9s} {'fused ms':>9s} {'speedup':>8s} {'plain GiB':>10s} {'fused GiB':>10s} "
          f"{'max rel err':>12s} {'capture err':>12s}")
    for name, row in report["results"].items():
        gib = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
        capture = max(row["captured_vs_eager"].values()) if "captured_vs_eager" in row else None
        print(f"{name:18s} {row['plain_ms']:9.2f} {row['fused_ms']:9.2f} {row['speedup']:8.3f} "
              f"{gib(row['plain_peak_gib']):>10s} {gib(row['fused_peak_gib']):>10s} "
              f"{max(row['fused_vs_plain'].values()):12.2e} {capture if capture is not None else '-':>12}")
    if report["skipped"]:
        print("skipped (time budget):", ", ".join(report["skipped"]))
    return report


if __name__ == "__main__":
    main()
