"""fp32 accuracy of the chunked full-mode routing (or, with --mode block, of BlockRouting, 2 sites per
block) at head width 96 (d 192, H 2, 7 sites), against float64, compared with PyTorch's own fp32 error on the
same draws. CPU, Triton interpreter; minutes per 10 draws in full mode, seconds in block mode.

    TRITON_INTERPRET=1 python benchmarks/precision_wide_head.py [--draws 30] [--mode full|block]

The stacks are the kernel tests' (tests/kernels/kernel_helpers: S_{s+1} = tanh(x_s @ M_s)).
Per draw: relative error of the final output and of the three gradients for (1) the Triton path, (2) torch
fp32, (3) torch fp32 on the same function with the features permuted inside each head (another rounding
order of the same algorithm: how far two fp32 evaluations of this chain differ by rounding alone). Prints
each draw, then the RMS over draws and how often each path exceeds max(1e-5, 2x torch fp32's error on that
draw) - the kernel tests' per-draw criterion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))

import torch  # noqa: E402
from kernel_helpers import (block_mode_output_and_grads, block_mode_problem, full_mode_output_and_grads,  # noqa: E402
                            full_mode_problem, permuted_within_heads, rel)

NAMES = ("output", "d_embedding", "d_query", "d_norm_weight")
SITES, D, HEADS = 7, 192, 2


MODES = ("full", "block")


def make_problem(mode, gen):
    return full_mode_problem(SITES, 2, 3, D, gen) if mode == "full" else block_mode_problem(SITES // 2, D, gen)


def evaluate(mode, kind, problem, dtype):
    if mode == "block":
        return block_mode_output_and_grads(kind, *problem, HEADS, 2, dtype)
    return full_mode_output_and_grads(kind, *problem, HEADS, dtype, chunk=3, group=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=30)
    parser.add_argument("--seed", type=int, default=100, help="first draw's seed")
    parser.add_argument("--mode", default="full", choices=MODES)
    args = parser.parse_args()
    rows = []
    for seed in range(args.seed, args.seed + args.draws):
        gen = torch.Generator().manual_seed(seed)
        problem = make_problem(args.mode, gen)
        exact = evaluate(args.mode, "torch", problem, torch.float64)
        ref32 = evaluate(args.mode, "torch", problem, torch.float32)
        moved, back = permuted_within_heads(problem, HEADS, gen)
        perm32 = back(evaluate(args.mode, "torch", moved, torch.float32))
        tri32 = evaluate(args.mode, "triton", problem, torch.float32)
        rows.append([(rel(t, x), rel(r, x), rel(p, x)) for t, r, p, x in zip(tri32, ref32, perm32, exact)])
        print(f"seed {seed}: " + "  ".join(f"{n} {t:.1e}/{r:.1e}/{p:.1e}" for n, (t, r, p) in zip(NAMES, rows[-1])),
              flush=True)
    print(f"\n{args.draws} draws, {args.mode} mode: RMS of the relative errors (triton / "
          "torch fp32 / torch fp32 permuted) and the share of draws above max(1e-5, 2x torch fp32's error)")
    for i, name in enumerate(NAMES):
        rms = [statistics.fmean(r[i][k] ** 2 for r in rows) ** 0.5 for k in range(3)]
        over = [sum(r[i][k] > max(1e-5, 2 * r[i][1]) for r in rows) / len(rows) for k in (0, 2)]
        print(f"  {name:14s} {rms[0]:.2e} / {rms[1]:.2e} / {rms[2]:.2e}  (ratio {rms[0] / rms[1]:.2f})  "
              f"above: triton {over[0]:.2f}, permuted torch {over[1]:.2f}")


if __name__ == "__main__":
    main()
