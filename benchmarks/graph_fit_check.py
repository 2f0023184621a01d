"""GPU check that a captured training step is the same function as an eager one, inside a real Lightning fit,
with gradient accumulation: the same seed, data and optimizer steps trained eagerly, eagerly with each step's
microbatches in reverse order (the same sum, another rounding order: the spread two correct runs show), and with
CUDA-graph capture, for our baseline and full MHAR (Triton routing, its first-batch check on). Passes where the
captured parameters after the last step differ from the eager ones by at most 1e-6 (relative L2) in fp32, and in
16-bit by at most 2x what the reversed-order eager run differs by (plus 1e-6). Writes JSON and prints a table.

    python benchmarks/graph_fit_check.py [--size demo] [--steps 4] [--accumulate 4] [--precision 32-true]
                                         [--methods baseline mhar] [--fused-loss] [--fused-ops] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mhar_lit.config import ModelConfig  # noqa: E402
from mhar_lit.lit.module import LanguageModel  # noqa: E402
from mhar_lit.lit.routing_backend import RoutingBackend  # noqa: E402
from mhar_lit.residual import FullAttnRes, StandardResidual  # noqa: E402

MICROBATCH = {"demo": (16, 256), "100M": (8, 2048), "350M": (4, 1024), "1B": (2, 1024)}
FP32_TOLERANCE = 1e-6


class _StepClock(L.Callback):
    def __init__(self) -> None:
        self.times, self.losses, self._t0 = [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.synchronize()
        self.times.append((time.perf_counter() - self._t0) * 1e3)
        self.losses.append(float(outputs["loss"]))


def fit(args, method: str, graph: bool, batches: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    torch.manual_seed(0)
    residual = StandardResidual() if method == "baseline" else FullAttnRes(heads=8 if args.size != "demo" else 4)
    module = LanguageModel(size=args.size, residual=residual, warmup_steps=1, lr=1e-3, cuda_graph=graph,
                           fused_loss=args.fused_loss, fused_ops=args.fused_ops)
    clock = _StepClock()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision=args.precision, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, RoutingBackend()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    steady = clock.times[2 * args.accumulate:] or clock.times  # the first step captures
    run = {"method": method, "cuda_graph": graph, "losses": clock.losses, "median_microbatch_ms":
           statistics.median(steady)}
    return run, [p.detach().float().clone() for p in module.parameters()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(x.pow(2).sum()) for x in a)
    return (num / den) ** 0.5


def check_method(args, method: str, batches: list[torch.Tensor]) -> dict:
    a = args.accumulate
    reordered = [m for s in range(0, len(batches), a) for m in reversed(batches[s:s + a])]
    eager, p_eager = fit(args, method, False, batches)
    _, p_reordered = fit(args, method, False, reordered)
    graphed, p_graphed = fit(args, method, True, batches)
    spread, diff = rel_diff(p_eager, p_reordered), rel_diff(p_eager, p_graphed)
    bound = FP32_TOLERANCE if args.precision.startswith("32") else 2 * spread + FP32_TOLERANCE
    return {"method": method, "param_rel_diff_captured_vs_eager": diff, "param_rel_diff_reordered_eager": spread,
            "bound": bound, "passed": diff <= bound, "eager": eager, "captured": graphed,
            "speedup": eager["median_microbatch_ms"] / graphed["median_microbatch_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="demo", choices=sorted(MICROBATCH))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--methods", nargs="+", default=["baseline", "mhar"], choices=["baseline", "mhar"])
    parser.add_argument("--fused-loss", action="store_true",
                        help="model.fused_loss (the paper recipes' loss; needs liger-kernel and CUDA)")
    parser.add_argument("--fused-ops", action="store_true",
                        help="model.fused_ops (the paper recipes' RMSNorm, RoPE and SiLU * up; liger-kernel, CUDA)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    b, t = MICROBATCH[args.size]
    gen = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_name(args.size).vocab_size
    batches = [torch.randint(0, vocab, (b, t + 1), generator=gen) for _ in range(args.steps * args.accumulate)]
    results = [check_method(args, method, batches) for method in args.methods]
    report = {"benchmark": "graph_fit_check", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "lightning": L.__version__,
              "size": args.size, "precision": args.precision, "fused_loss": args.fused_loss,
              "fused_ops": args.fused_ops, "accumulate": args.accumulate, "steps": args.steps,
              "results": results, "passed": all(r["passed"] for r in results)}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    print(f"\n{'method':<9} {'captured vs eager':>18} {'reordered eager':>16} {'bound':>9} {'speedup':>8} passed")
    for r in results:
        print(f"{r['method']:<9} {r['param_rel_diff_captured_vs_eager']:>18.2e} "
              f"{r['param_rel_diff_reordered_eager']:>16.2e} {r['bound']:>9.1e} {r['speedup']:>8.2f} {r['passed']}")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
