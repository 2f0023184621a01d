"""Target program for Nsight Compute: one routing forward + backward of one microbatch (full or block mode), the
profiled range opened around the last of a few iterations (earlier ones compile and warm up).

    ncu --profile-from-start off --kernel-name regex:_block_pass_bwd_kernel --launch-count 2 \\
        python3 benchmarks/ncu_routing.py --mode block --shape 1B [knob=value ...]

benchmarks/ncu_suite.sh runs it for the kernels worth reading and prints the stall reasons, occupancy and
memory throughput. Knobs are the routing class's keywords (FullRouting or BlockRouting), as in the other scripts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import block_routing  # noqa: E402
import routing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["full", "block"], required=True)
    parser.add_argument("--shape", choices=list(routing.SHAPES), required=True)
    parser.add_argument("--iters", type=int, default=3, help="iterations; the last one is profiled")
    parser.add_argument("knobs", nargs="*", help="key=value routing keywords")
    args = parser.parse_args()
    options = routing.parse_options(",".join(args.knobs), "knobs") if args.knobs else {}
    if args.mode == "block":
        strat = block_routing.make_strategy(args.shape, "triton", torch.bfloat16, options)
        prob = block_routing.make_problem(args.shape, None, torch.bfloat16)
        step = lambda: block_routing.run_once(strat, prob)  # noqa: E731
    else:
        d, L, H, B, T = routing.SHAPES[args.shape]
        prob = routing.make_problem(d, L, H, B, T, torch.bfloat16)
        step = lambda: routing.run_once(prob, "triton", options=options)  # noqa: E731
    for _ in range(args.iters - 1):
        step()
    if routing.DEVICE != "cuda":  # a CPU smoke run (TRITON_INTERPRET=1 --shape tiny): nothing to profile
        step()
    else:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_routing: {args.mode} {args.shape} {options or 'defaults'} done")


if __name__ == "__main__":
    main()
