"""GPU check of LanguageModel(cuda_graph=True) inside a real Lightning fit: the same seed, data and steps with
and without capture, for our baseline and full MHAR (Triton routing); per-step losses must agree (the
captured kernels are the eager ones; non-deterministic backward kernels allow small differences) and the
step times show what capture buys. Writes JSON (device, versions, date, command) and prints a table.

    python benchmarks/graph_fit_check.py [--size 350M] [--steps 12] [--out FILE]
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
from mhar_lit.residual import FullAttnRes, StandardResidual  # noqa: E402

MICROBATCH = {"100M": (8, 2048), "350M": (4, 1024), "1B": (2, 1024)}


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


def fit(size: str, method: str, graph: bool, batches: list[torch.Tensor]) -> dict:
    torch.manual_seed(0)
    residual = StandardResidual() if method == "baseline" else FullAttnRes(heads=8)
    if method != "baseline":
        residual.set_routing_backend("triton")
    module = LanguageModel(size=size, residual=residual, warmup_steps=2, lr=3e-4, cuda_graph=graph)
    clock = _StepClock()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-true", max_steps=len(batches),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    steady = clock.times[2:]  # the first step compiles / captures
    return {"size": size, "method": method, "cuda_graph": graph, "losses": clock.losses,
            "step_ms": clock.times, "median_ms": statistics.median(steady)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="350M")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    b, t = MICROBATCH[args.size]
    gen = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_name(args.size).vocab_size
    batches = [torch.randint(0, vocab, (b, t + 1), generator=gen) for _ in range(args.steps)]
    runs = [fit(args.size, method, graph, batches) for method in ("baseline", "mhar") for graph in (False, True)]
    for method in ("baseline", "mhar"):
        eager, graphed = (r for r in runs if r["method"] == method)
        diff = max(abs(a - c) / abs(a) for a, c in zip(eager["losses"], graphed["losses"]))
        graphed["max_rel_loss_diff_vs_eager"] = diff
        graphed["speedup_vs_eager"] = eager["median_ms"] / graphed["median_ms"]
    import triton

    report = {"benchmark": "graph_fit_check", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "lightning": L.__version__, "runs": runs}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    print(f"\n{'method':<9} {'graph':<6} {'median ms':>9} {'speedup':>8} {'max rel loss diff':>18}  losses")
    for r in runs:
        print(f"{r['method']:<9} {str(r['cuda_graph']):<6} {r['median_ms']:>9.1f} "
              f"{r.get('speedup_vs_eager', 1.0):>8.2f} {r.get('max_rel_loss_diff_vs_eager', 0.0):>18.2e}  "
              + " ".join(f"{x:.4f}" for x in r["losses"][:6]))


if __name__ == "__main__":
    main()
