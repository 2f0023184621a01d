"""How far a correct router and a 1%-wrong one sit from the float64 reference under the router check's measure.

For each (shape, mode, heads, dtype) and seed it runs mhar_lit.routing.check.runs (every router on the same
rounded inputs) and records per compared tensor the max-entry, whole-tensor (L2) and scale errors of the PyTorch
router in the same dtype ("eager"), of the Triton router ("triton"), and of the Triton router's tensor scaled by
1.01 ("defect", a gradient off by 1%). Also one long-token case (16K tokens, the 100M microbatch) for the accuracy
of the kernels' reductions over tokens. GPU only.

    python benchmarks/router_check_noise.py --out results.json [--budget-s 400] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mhar_lit.routing import check

SHAPES = {"100M": (512, 12), "350M": (1024, 24), "1B": (1280, 36), "8B": (4096, 32)}


def case_stats(shape: str, mode: str, heads: int, dtype: torch.dtype, seed: int, tokens: int,
               batch: int = 1) -> dict:
    width, layers = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(batch, tokens, width, generator=gen, dtype=torch.float64).cuda()
    options = {"span": 4} if mode == "block" else {}
    ref, eager, triton = check.runs(mode, "triton", heads, emb, 2 * layers + 1, dtype, router_options=options,
                                    seed=seed)
    return {name: {"eager": check.errors(eager[name], ref[name]), "triton": check.errors(triton[name], ref[name]),
                   "defect": check.errors(triton[name] * 1.01, ref[name])} for name in check.COMPARED}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=400)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    t0 = time.time()
    rows = []
    plan = [(s, m, h, d, 256) for d in (torch.bfloat16, torch.float32) for s in SHAPES for m in ("full", "block", "call")
            for h in (1, 8)]
    plan = [(s, m, h, torch.bfloat16, 64) for s in ("100M", "350M", "1B") for m in ("full", "block") for h in (1, 8)] + plan
    for shape, mode, heads, dtype, tokens in plan:
        if time.time() - t0 > args.budget_s:
            break
        if mode == "full" and dtype == torch.float32 and SHAPES[shape][0] // heads > 512:
            continue  # refused by design (full_routing.max_head_width)
        for seed in range(args.seeds):
            try:
                stats = case_stats(shape, mode, heads, dtype, seed, tokens)
            except Exception as err:  # record, keep going
                stats = {"error": f"{type(err).__name__}: {err}"[:300]}
            rows.append({"shape": shape, "mode": mode, "heads": heads, "dtype": str(dtype).split(".")[-1],
                         "tokens": tokens, "seed": seed, "stats": stats})
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"))
        print(f"{time.time() - t0:6.0f}s {shape} {mode} H{heads} {dtype} T{tokens}", flush=True)
    long_case = {}
    if time.time() - t0 < args.budget_s:
        long_case = case_stats("100M", "full", 8, torch.bfloat16, 0, 2048, batch=8)
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "long_16k": long_case,
               "seconds": time.time() - t0}, open(args.out, "w"))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """grad_query and grad_norm (the tensors the kernels reduce over tokens): L2 of triton / eager, and the scale
    errors, per row."""
    print(f"{'case':<34} {'dq L2 tri/eager':>18} {'dg L2 tri/eager':>18} {'dq scale':>9} {'dg scale':>9}")
    for r in rows:
        st = r["stats"]
        name = f"{r['shape']} {r['mode']} H{r['heads']} {r['dtype']} T{r['tokens']} s{r['seed']}"
        if "error" in st:
            print(f"{name:<34} {st['error'][:80]}")
            continue
        q, g = st["grad_query"], st["grad_norm"]
        print(f"{name:<34} {q['triton']['l2']:>8.2e}/{q['eager']['l2']:.2e} {g['triton']['l2']:>8.2e}/"
              f"{g['eager']['l2']:.2e} {q['triton']['scale']:>+9.1e} {g['triton']['scale']:>+9.1e}")


if __name__ == "__main__":
    main()
