"""Block-mode routing benchmark: all 2L+1 routing sites of one microbatch (BlockAttnRes), forward + backward.

    python benchmarks/block_routing.py [--shapes 100M 350M 1B] [--variants torch torch_two_phase triton]
                                       [--configs 4x2048 8x2048] [--graph] [--out benchmarks/results]

The strategy object itself is driven (begin / sublayer_input / sublayer_output / final), with the sublayers
replaced as in benchmarks/routing.py by precomputed outputs tied to the site outputs (_Tie), so the partial
sums, block boundaries and autograd order are the model's. Variants:
  torch           BlockAttnRes on the torch router: stacked sources, the eager PyTorch reference
  torch_two_phase BlockAttnRes(two_phase=True) on the torch router: docs/method.md D's two-phase computation
  triton          BlockAttnRes on the triton router: BlockRouting, one shared row buffer (--configs: its kernels'
                  warps x tile elements)
Every variant and config is first checked on the GPU against the fp32 reference (fp32 and bf16 storage, fewer
tokens). Times: CUDA events after warm-up, medians (on a machine without CUDA: wall-clock medians of the torch
variants, with --tokens to shrink the microbatch); --forward-only times the forward alone under no_grad (the
inference case two_phase is for); --graph also replays each triton config from a CUDA graph
(kernel time without host launch cost). Bytes: the traffic the shared-buffer kernels move (traffic_bytes),
for a bandwidth floor. Prints a table last; writes JSON under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from routing import (DEVICE, SHAPES, _Tie, copy_bandwidth, cuda_event_times, cuda_kernel_totals,  # noqa: E402
                     parse_options, rel)

from mhar_lit.config import ModelConfig  # noqa: E402
from mhar_lit.residual import BlockAttnRes  # noqa: E402

BLOCK_LAYERS = {"100M": 2, "350M": 3, "1B": 6, "tiny": 1}  # as benchmarks/train_step.py


def make_strategy(shape_name, variant, dtype, config=None):
    d, L, H, _, _ = SHAPES[shape_name]
    backend = "torch" if variant.startswith("torch") else "triton"
    strat = BlockAttnRes(heads=H, layers_per_block=BLOCK_LAYERS[shape_name], two_phase=variant == "torch_two_phase")
    # BlockRoutingConfig fields; empty: the measured defaults
    strat.set_routing_backend(backend, dict(config or {}) if backend == "triton" else None)
    strat.bind(ModelConfig(hidden_size=d, num_layers=L, num_heads=H, num_kv_heads=H, vocab_size=16))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        strat.query.copy_(torch.randn(strat.query.shape, generator=gen) * 0.5)
        strat.key_norm.copy_(1 + 0.2 * torch.randn(strat.key_norm.shape, generator=gen))
    return strat.to(device=DEVICE, dtype=dtype)


def make_problem(shape_name, tokens, dtype, seed=0):
    d, L, _, B, T = SHAPES[shape_name]
    b, t = (1, tokens) if tokens else (B, T)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n = 2 * L + 1
    kw = dict(device=DEVICE, generator=gen)
    ys = [(torch.randn(b, t, d, **kw) * (0.5 + s % 3)).to(dtype) for s in range(n)]  # ys[0]: the embedding
    douts = [torch.randn(b, t, d, **kw).to(dtype) for _ in range(n)]
    return dict(n=n, ys=ys, douts=douts)


def forward_sites(strat, ys, douts=None):
    """The forward of every site on the sublayer outputs ys (ys[0]: the embedding); with douts, each output is
    tied to its site's input (_Tie) so that the backward reaches every site. Returns the final site's output."""
    state = strat.begin(ys[0])
    for s in range(len(ys) - 1):
        x = strat.sublayer_input(state, s)
        state = strat.sublayer_output(state, s, ys[s + 1] if douts is None else _Tie.apply(x, ys[s + 1], douts[s]))
    return strat.final(state)


def run_once(strat, prob):
    """Forward + backward of every site; returns the leaves (embedding and sublayer outputs)."""
    leaves = [y.detach().requires_grad_() for y in prob["ys"]]
    strat.zero_grad(set_to_none=True)
    forward_sites(strat, leaves, prob["douts"]).backward(prob["douts"][-1])
    return leaves


def run_forward(strat, prob):
    """The forward of every site under no_grad (inference)."""
    with torch.no_grad():
        return forward_sites(strat, prob["ys"])


def grads(strat, leaves):
    return [torch.stack([leaf.grad for leaf in leaves]), strat.query.grad, strat.key_norm.grad]


def check(shape_name, variant, config, tokens=256):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = make_strategy(shape_name, "torch", torch.float32)
        exact = grads(ref, run_once(ref, _as(make_problem(shape_name, tokens, dtype, seed=1), torch.float32)))
        strat = make_strategy(shape_name, variant, dtype, config)
        got = grads(strat, run_once(strat, make_problem(shape_name, tokens, dtype, seed=1)))
        errs = [rel(a, b) for a, b in zip(got, exact)]
        if dtype == torch.bfloat16:
            low = make_strategy(shape_name, "torch", dtype)
            ref_errs = [rel(a, b) for a, b in zip(grads(low, run_once(low, make_problem(shape_name, tokens, dtype, 1))),
                                                  exact)]
            out["bf16"] = dict(errors=errs, reference_errors=ref_errs,
                               ok=all(e <= 2 * r + 1e-3 for e, r in zip(errs, ref_errs)))
        else:
            out["fp32"] = dict(errors=errs, ok=all(e <= 1e-4 for e in errs))
    return out


def _as(prob, dtype):
    return dict(prob, ys=[y.to(dtype) for y in prob["ys"]], douts=[g.to(dtype) for g in prob["douts"]])


def time_eager(strat, prob, warmup, reps, forward_only=False):
    run = (lambda _: run_forward(strat, prob)) if forward_only else (lambda _: run_once(strat, prob))
    for _ in range(warmup):
        run(None)
    if DEVICE == "cuda":
        return cuda_event_times(run, reps)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run(None)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times


def time_graphed(strat, prob, warmup, reps):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run_once(strat, prob)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_once(strat, prob)
    graph.replay()
    result = cuda_event_times(lambda _: graph.replay(), reps)
    del graph
    return result


def kernel_times(strat, prob):
    """CUDA time per kernel name (ms, summed over launches) and launch counts of one fwd+bwd, torch.profiler."""
    run_once(strat, prob)
    torch.cuda.synchronize()
    totals, counts = cuda_kernel_totals(lambda: run_once(strat, prob))
    return {name: dict(ms=ms, launches=counts[name]) for name, ms in totals.most_common()}


def traffic_bytes(shape_name, itemsize):
    """HBM bytes BlockRouting's kernels move per forward + backward (the design of 2026-12-04), every re-read
    counted as a new read (so a floor only where caches do not catch them). Counted in rows of P x D in the
    storage dtype (an fp32 row is 4 / itemsize of them; a [P, H] fp32 pair quantity, as S, lse or dl, is
    4 H / (D itemsize)). Forward, per site: y read, own row written (and the previous partial read where it
    continues one), its block rows read, out written. Backward, per site: dout and out read, S written; where
    the own row is a partial sum: that row read, the next site's dsrc read as the chain (not at the final
    site), dsrc and the pair's dl written. Per block (at its first site), for each block row j <= k: the row,
    the block's douts (re-read per row), S and lse read and dl written per pair, G read (not in the last block)
    and written, or for j = k, dsrc written. dq/dg pass: every row and every pair's dl (once per K-slice of 32)
    read, per-64-token partials [n, D] fp32 written and summed on the host."""
    d, L, heads, B, T = SHAPES[shape_name]
    n, span, p = 2 * L + 1, 2 * BLOCK_LAYERS[shape_name], B * T
    blocks = -(-(n - 1) // span)
    fp32_row, pair = 4 / itemsize, 4 * heads / (d * itemsize)
    block_rows = lambda s: -(-s // span)  # noqa: E731
    starts = lambda s: s < n - 1 and s % span == 0  # noqa: E731
    rows = 0.0
    for s in range(n):
        rows += 3 + block_rows(s) + (s > 0 and not starts(s - 1))  # forward
        rows += 2 + pair  # backward site kernel: dout, out; S
        if not starts(s):
            rows += 2 + (s < n - 1) + pair  # own row, dsrc, chain; dl
    for k in range(blocks):
        slots = n - k * span if k == blocks - 1 else span
        g_read = 0 if k == blocks - 1 else fp32_row
        rows += (k + 1) * (1 + slots * (1 + 3 * pair) + g_read)  # rows, douts, S / lse / dl, G read
        rows += k * fp32_row + 1  # G written for j < k; dsrc of row k
    k_slices = -(-(d // heads) // 32)
    pairs = sum(block_rows(s) + 1 for s in range(n))
    rows += n + pairs * pair * k_slices + 2 * (-(-p // 64)) * n * fp32_row / p  # dq/dg pass
    return int(rows * p * d * itemsize)


def pow2(x):
    return 1 << max(0, x - 1).bit_length()


def parse_config(text):
    """'default' -> None; 'WxTILE' -> num_warps, tile_elements; 'key=value,...' -> those BlockRouting keywords
    (integers), e.g. 'pass_tile_elements=2048,pass_warps=4'."""
    if text == "default":
        return None
    if "=" in text:
        return parse_options(text, f"--configs {text}")
    warps, tile = (int(x) for x in text.split("x"))
    return dict(num_warps=warps, tile_elements=tile)


def config_label(config):
    return ",".join(f"{k}={v}" for k, v in config.items()) if config else "defaults"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["100M", "350M", "1B"], choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["torch", "torch_two_phase", "triton"],
                        choices=["torch", "torch_two_phase", "triton"])
    parser.add_argument("--configs", nargs="+", default=["default"],
                        help="triton warps x tile elements: BlockRouting's num_warps (0: automatic) and "
                             "tile_elements; or key=value,... of any BlockRouting keywords; 'default': its defaults")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also per-kernel CUDA times of each triton config")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=0, help="time on one sequence of this many tokens (0: the "
                        "shape's microbatch)")
    parser.add_argument("--forward-only", action="store_true", help="time the forward alone, under no_grad")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.configs]
    bandwidth = copy_bandwidth()
    results, rows, profiles = [], [], []
    for shape_name in args.shapes:
        prob = make_problem(shape_name, args.tokens, torch.bfloat16)
        for variant in args.variants:
            for config in (configs if variant == "triton" else [None]):
                scale = args.tokens / (SHAPES[shape_name][3] * SHAPES[shape_name][4]) if args.tokens else 1.0
                floor = scale * traffic_bytes(shape_name, 2) / bandwidth * 1e3
                label = variant + (" " + config_label(config) if variant == "triton" else "")
                checked = check(shape_name, variant, config)
                ok = checked["fp32"]["ok"] and checked["bf16"]["ok"]
                entry = dict(shape=shape_name, variant=variant, config=config, check=checked, floor_ms=floor)
                if not ok:
                    rows.append((shape_name, label, "CHECK FAILED", "", ""))
                    results.append(entry)
                    continue
                strat = make_strategy(shape_name, variant, torch.bfloat16, config)
                timed = DEVICE == "cuda" or variant.startswith("torch")  # the interpreter's times mean nothing
                median, times = (time_eager(strat, prob, args.warmup, args.reps, args.forward_only) if timed
                                 else (0.0, []))
                entry.update(eager_ms=median, eager_times=times)
                graphed = ""
                if args.graph and variant == "triton" and DEVICE == "cuda" and not args.forward_only:
                    entry["graph_ms"], entry["graph_times"] = time_graphed(strat, prob, args.warmup, args.reps)
                    graphed = f"{entry['graph_ms']:.2f}"
                if args.profile and variant == "triton" and DEVICE == "cuda" and not args.forward_only:
                    entry["kernels"] = kernel_times(strat, prob)
                    profiles.append((shape_name, label, entry["kernels"]))
                results.append(entry)
                rows.append((shape_name, label, f"{median:.2f}", graphed, f"{floor:.2f}"))
                del strat
                torch.cuda.empty_cache() if DEVICE == "cuda" else None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%S")
    meta = dict(date=stamp, command=shlex.join(sys.argv), torch=torch.__version__,
                device=torch.cuda.get_device_name() if DEVICE == "cuda" else f"cpu ({os.cpu_count()} cores)",
                bandwidth_Bps=bandwidth, tokens=args.tokens, forward_only=args.forward_only)
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"block_routing_{stamp}.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    for shape_name, label, kernels in profiles:
        print(f"\n{shape_name} {label}: kernels {sum(k['ms'] for k in kernels.values()):.2f} ms")
        for name, k in list(kernels.items())[:8]:
            print(f"  {k['ms']:8.3f} ms  x{k['launches']:4d}  {name}")
    print(f"\n{'shape':6s} {'variant':44s} {'eager ms':>10s} {'graph ms':>9s} {'floor ms':>9s}")
    for row in rows:
        print(f"{row[0]:6s} {row[1]:44s} {row[2]:>10s} {row[3]:>9s} {row[4]:>9s}")


if __name__ == "__main__":
    main()
