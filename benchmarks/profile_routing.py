"""Where the chunked Triton routing spends its time: per-kernel CUDA time of one fwd+bwd of all sites
(torch.profiler) against the CUDA-event wall time, and each compiled kernel's registers and spills.

    python benchmarks/profile_routing.py [--shapes 100M 350M 1B]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from routing import SHAPES, cuda_kernel_totals, make_problem, parse_grid, run_once  # noqa: E402

CONFIGS = [  # the defaults first (full_routing.DEFAULT_*), then alternatives
    dict(),
    dict(chunk=8, group=8, num_warps=4, tile_elements=4096),
]


def kernel_table(prob, options):
    run_once(prob, "triton", options=options)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_once(prob, "triton", options=options)
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end)
    totals, counts = cuda_kernel_totals(lambda: run_once(prob, "triton", options=options))
    return wall, totals, counts


def print_registers():
    from mhar_lit.kernels import full_backward, full_forward

    kernels = {n: k for m in (full_forward, full_backward) for n, k in vars(m).items() if n.endswith("_kernel")}
    for name in sorted(kernels):  # every kernel, the new ones too
        fn = kernels[name]
        for caches in getattr(fn, "device_caches", {}).values():
            cache = caches[0] if isinstance(caches, tuple) else caches
            for compiled in cache.values():
                meta = getattr(compiled, "metadata", None)
                print(f"  {name:22s} regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')}"
                      f" warps {getattr(meta, 'num_warps', '?')} smem {getattr(meta, 'shared', '?')}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["100M", "350M", "1B"])
    parser.add_argument("--configs", default=None,
                        help="configurations to profile after the defaults, in routing.py's --grid format")
    args = parser.parse_args()
    configs = [dict()] + parse_grid(args.configs) if args.configs is not None else CONFIGS
    for shape in args.shapes:
        d, L, H, B, T = SHAPES[shape]
        prob = make_problem(d, L, H, B, T, torch.bfloat16)
        for options in configs:
            wall, totals, counts = kernel_table(prob, options)
            busy = sum(totals.values())
            print(f"\n{shape} {options}: wall {wall:.2f} ms, kernels {busy:.2f} ms")
            for name, ms in totals.most_common(10):
                print(f"  {ms:8.2f} ms  x{counts[name]:4d}  {name}")
        del prob
        torch.cuda.empty_cache()
    print_registers()


if __name__ == "__main__":
    main()
