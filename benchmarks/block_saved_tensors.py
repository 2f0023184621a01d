"""Bytes autograd keeps for the backward of block routing (all 2L+1 sites), direct vs two-phase, any device.

    python benchmarks/block_saved_tensors.py [--tokens 1024]

Counts the distinct storages packed by torch.autograd.graph.saved_tensors_hooks during the forward of
benchmarks/block_routing.py's problem (bf16 storage, one sequence of --tokens tokens), leaving out the inputs
(the embedding and sublayer outputs, which the model keeps anyway). A device-free stand-in for peak memory.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from block_routing import forward_sites, make_problem, make_strategy  # noqa: E402


def saved_bytes(variant: str, shape: str, tokens: int) -> int:
    strat = make_strategy(shape, variant, torch.bfloat16)
    prob = make_problem(shape, tokens, torch.bfloat16)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [y.detach().requires_grad_() for y in prob["ys"]]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_sites(strat, leaves, prob["douts"])
    inputs = {leaf.untyped_storage().data_ptr() for leaf in leaves}
    return sum(n for ptr, n in storages.items() if ptr not in inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["100M", "350M", "1B"])
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    print(f"{'shape':6s} {'torch MiB':>10s} {'two-phase MiB':>14s}   (saved for backward, {args.tokens} tokens, bf16)")
    for shape in args.shapes:
        direct, two = (saved_bytes(v, shape, args.tokens) / 2**20 for v in ("torch", "torch_two_phase"))
        print(f"{shape:6s} {direct:10.1f} {two:14.1f}")


if __name__ == "__main__":
    main()
