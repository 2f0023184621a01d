"""Check and time FullRouting's side-stream schedule (overlap) against real concurrent work, on a GPU.

    python benchmarks/overlap_check.py [--shapes 100M 350M 1B] [--reps 10] [--out DIR]

A full-mode stack at the routing benchmark's shapes (bf16 storage) whose sublayers are an MLP (d -> 4d -> d,
SiLU; weights fixed): while the side stream runs a prefix or suffix pass, the sublayer's matrix products run
on the current stream, so a missing wait would show as a wrong result. For overlap in off / normal / high:
1. eager forward + backward, gradients of the embedding, queries and key-norm weights;
2. the same captured in one CUDA graph and replayed (what LanguageModel(cuda_graph=True) runs).
Every result must be bitwise equal to overlap="off" in the same mode (the kernels and their inputs are the
same; only the timing differs); then each mode is timed (CUDA events, median of --reps after warm-up).
Writes overlap_check.json (device, versions, date, command) and prints a table last; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mhar_lit.kernels.full_routing import OVERLAP_CHOICES, FullRouting  # noqa: E402

SHAPES = {"100M": (512, 12, 8, 8, 2048), "350M": (1024, 24, 8, 4, 1024), "1B": (1280, 36, 8, 2, 1024)}


def make_problem(d, L, B, T, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=gen)
    n = 2 * L + 1
    return dict(
        n=n,
        emb=torch.randn(B, T, d, **kw).bfloat16(),
        q=(torch.randn(n, d, **kw) * 0.5).bfloat16(),
        g=(1 + 0.2 * torch.randn(n, d, **kw)).bfloat16(),
        w1=(torch.randn(d, 4 * d, **kw) / d ** 0.5).bfloat16(),
        w2=(torch.randn(4 * d, d, **kw) / (4 * d) ** 0.5).bfloat16(),
        dout=torch.randn(B, T, d, **kw).bfloat16(),
    )


def leaves_of(prob):
    return [prob[k].detach().requires_grad_() for k in ("emb", "q", "g")]


def step(prob, leaves, heads, overlap):
    emb, q, g = leaves
    routing = FullRouting(emb, q, g, heads, overlap=overlap)
    source, x = emb, None
    for s in range(prob["n"]):
        x = routing.route(s, source, *((q, g) if s == 0 else (None, None)))
        if s < prob["n"] - 1:
            source = F.silu(x @ prob["w1"]) @ prob["w2"]
    x.backward(prob["dout"])


def eager_result(prob, heads, overlap):
    leaves = leaves_of(prob)
    step(prob, leaves, heads, overlap)
    torch.cuda.synchronize()
    return [leaf.grad.clone() for leaf in leaves]


def capture(prob, heads, overlap, warmup=2):
    leaves = leaves_of(prob)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph requires
        for _ in range(warmup):
            step(prob, leaves, heads, overlap)
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(prob, leaves, heads, overlap)
    return graph, leaves


def event_median(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def run_shape(name, reps):
    d, L, H, B, T = SHAPES[name]
    prob = make_problem(d, L, B, T)
    entry, ok = {"d": d, "L": L, "H": H, "B": B, "T": T}, True
    reference = {}
    for overlap in OVERLAP_CHOICES:
        eager = eager_result(prob, H, overlap)
        graph, leaves = capture(prob, H, overlap)
        graph.replay()
        torch.cuda.synchronize()
        graphed = [leaf.grad.clone() for leaf in leaves]
        reference.setdefault("eager", eager)
        reference.setdefault("graph", graphed)
        same = {mode: all(torch.equal(a, b) for a, b in zip(got, reference[mode]))
                for mode, got in (("eager", eager), ("graph", graphed))}
        eager_vs_graph = max(((a.double() - b.double()).norm() / b.double().norm()).item()
                             for a, b in zip(graphed, eager))
        eager_ms, eager_times = event_median(lambda: step(prob, leaves_of(prob), H, overlap), reps)
        graph_ms, graph_times = event_median(graph.replay, reps)
        del graph, leaves
        torch.cuda.empty_cache()
        ok &= same["eager"] and same["graph"]
        entry[overlap] = dict(bitwise_equal_to_off=same, graph_vs_eager_rel=eager_vs_graph, eager_ms=eager_ms,
                              eager_times=eager_times, graph_ms=graph_ms, graph_times=graph_times)
        print(f"{name} overlap={overlap:6s} equal to off: eager {same['eager']} graph {same['graph']}; "
              f"graph vs eager {eager_vs_graph:.1e}; eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms", flush=True)
    return entry, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("overlap_check.py needs a CUDA GPU (the side stream exists only there)")
        return 2
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, python=platform.python_version(),
                  date=dt.datetime.now(dt.timezone.utc).isoformat(), command=" ".join(sys.argv), shapes={})
    ok = True
    for name in args.shapes:
        result["shapes"][name], shape_ok = run_shape(name, args.reps)
        ok &= shape_ok
    result["ok"] = ok
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overlap_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n| shape | " + " | ".join(f"{o} eager / graph ms" for o in OVERLAP_CHOICES) + " | bitwise equal |")
    print("|---|" + "---|" * (len(OVERLAP_CHOICES) + 1))
    for name, e in result["shapes"].items():
        cells = [f"{e[o]['eager_ms']:.2f} / {e[o]['graph_ms']:.2f}" for o in OVERLAP_CHOICES]
        equal = all(all(e[o]["bitwise_equal_to_off"].values()) for o in OVERLAP_CHOICES)
        print(f"| {name} | " + " | ".join(cells) + f" | {equal} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
