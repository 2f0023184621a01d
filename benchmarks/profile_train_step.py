"""Where a training step's time goes: one step (forward, backward, clip, fused AdamW) per method under
torch.profiler, against its CUDA-event wall time. Prints, per (size, method): wall ms, GPU busy ms (sum of
kernel times; one stream, so they do not overlap), the idle gap (wall - busy: host-bound stretches),
the number of kernel launches, and the top kernels by time.

    python benchmarks/profile_train_step.py [--sizes 1B] [--methods baseline mhar] [--top 12]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from routing import cuda_kernel_totals  # noqa: E402
from train_step import MICROBATCH, setup, train_step  # noqa: E402


def profile(size: str, method: str, top: int) -> None:
    model, opt = setup(size, method, "triton")
    b, t = MICROBATCH[size]
    batch = torch.randint(0, model.config.vocab_size, (b, t + 1), device="cuda")
    for _ in range(3):
        train_step(model, opt, method, batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    train_step(model, opt, method, batch)
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end)
    totals, counts = cuda_kernel_totals(lambda: train_step(model, opt, method, batch), width=70)
    busy = sum(totals.values())
    routing = sum(v for k, v in totals.items() if k.startswith("_") and "kernel" in k)
    print(f"\n{size} {method}: wall {wall:.1f} ms, GPU busy {busy:.1f} ms, idle {wall - busy:.1f} ms, "
          f"{sum(counts.values())} kernels, routing kernels {routing:.1f} ms")
    for name, ms in totals.most_common(top):
        print(f"  {ms:8.2f} ms x {counts[name]:4d}  {name}")
    del model, opt
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=["1B"])
    parser.add_argument("--methods", nargs="+", default=["baseline", "mhar"])
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for size in args.sizes:
        for method in args.methods:
            profile(size, method, args.top)


if __name__ == "__main__":
    main()
