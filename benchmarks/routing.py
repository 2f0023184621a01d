"""Routing-only benchmark: all 2L+1 full-mode routing calls of one microbatch, forward + backward.

    python benchmarks/routing.py [--shapes 100M 350M 1B] [--variants torch compile triton triton_percall]
                                 [--tune] [--out benchmarks/results]

Sublayers are replaced by precomputed random outputs y_s tied to the site outputs x_s by a zero-cost
autograd node (its backward hands x_s a precomputed random gradient), so autograd visits the sites in the
same strict reverse order as in the model and only routing work is timed. Variants:
  torch           the eager PyTorch reference (route(torch.stack(sources), ...) per site)
  compile         torch.compile of the reference routing function (dynamic shapes: one graph for all N)
  triton_percall  the per-call fused kernel (stack + route_triton per site; the paper's algorithm, retiled)
  triton          chunked cross-site reuse (mhar_lit.kernels.full_routing.FullRouting)
Before timing, every variant is checked on the GPU against the fp32 reference at the same depth and width
with fewer tokens. Times: CUDA events around forward + backward after warm-up, median of repetitions.
Prints a short table last; writes JSON and a markdown summary under --out.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mhar_lit.routing import route, route_reference  # noqa: E402

SHAPES = {  # name: (d, L, H, B, T); full mode has 2L+1 sites
    "100M": (512, 12, 8, 8, 2048),
    "350M": (1024, 24, 8, 4, 1024),
    "1B": (1280, 36, 8, 2, 1024),
}
TARGET_MS = {"100M": 4.0, "350M": 7.0, "1B": 12.0}
# A CPU smoke test of this script (TRITON_INTERPRET=1, --shapes tiny) catches mistakes before GPU time.
SHAPES["tiny"], TARGET_MS["tiny"] = (32, 2, 4, 1, 16), 0.0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Tie(torch.autograd.Function):
    """S_{s+1} = y_s, made to depend on x_s: backward gives x_s a fixed gradient (the sublayer's stand-in)."""

    @staticmethod
    def forward(ctx, x, y, dx):
        ctx.dx = dx
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return ctx.dx, dy, None


def make_problem(d, L, H, B, T, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n = 2 * L + 1
    kw = dict(device=DEVICE, generator=gen)
    ys = [torch.randn(B, T, d, **kw).to(dtype) * (0.5 + s % 3) for s in range(n)]  # ys[0] is the embedding
    douts = [torch.randn(B, T, d, **kw).to(dtype) for _ in range(n)]
    q = (torch.randn(n, d, **kw) * 0.5).to(dtype)
    g = (1 + 0.2 * torch.randn(n, d, **kw)).to(dtype)
    return dict(n=n, H=H, ys=ys, douts=douts, q=q, g=g)


def site_fn_torch(q, g, H, fn):
    return lambda s, sources, routing: fn(torch.stack(sources), q[s], g[s], H)


def run_once(prob, variant, leaves=None, compiled=None, options=None):
    """Forward + backward of all sites; returns (leaves for grads)."""
    n, H = prob["n"], prob["H"]
    if leaves is None:
        leaves = fresh_leaves(prob)
    ys, q, g = leaves[:n], leaves[n], leaves[n + 1]
    routing = None
    if variant == "triton":
        from mhar_lit.kernels.full_routing import FullRouting

        routing = FullRouting(ys[0], q, g, H, config=options)
    sources = [ys[0]]
    x = None
    for s in range(n):
        if variant == "triton":
            x = routing.route(s, sources[-1], *((q, g) if s == 0 else (None, None)))
        elif variant == "torch":
            x = route(torch.stack(sources), q[s], g[s], H)
        elif variant == "compile":
            x = compiled(torch.stack(sources), q[s], g[s], H)
        elif variant == "triton_percall":
            x = route(torch.stack(sources), q[s], g[s], H, backend="triton")
        if s < n - 1:
            sources.append(_Tie.apply(x, ys[s + 1], prob["douts"][s]))
    x.backward(prob["douts"][n - 1])
    return leaves


def grads_of(leaves):
    n = len(leaves) - 2
    return [torch.stack([leaf.grad for leaf in leaves[:n]]), leaves[n].grad, leaves[n + 1].grad]


def parse_options(text: str, context: str) -> dict:
    """'key=value,key=value' (integer values) -> routing-class keywords; `context` names the argument in errors.
    Shared by block_routing.py --configs and train_step.py's "method:options"."""
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise SystemExit(f"{context}: options must be key=integer pairs separated by commas, got {item!r}")
        options[key] = int(value)
    return options


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(shape_name, variant, compiled, options, tokens=256):
    """Relative errors vs the fp32 reference on fp32 and on bf16 storage (depth and width of the shape)."""
    d, L, H, _, _ = SHAPES[shape_name]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        prob = make_problem(d, L, H, 1, tokens, dtype, seed=1)
        ref32 = make_problem(d, L, H, 1, tokens, dtype, seed=1)
        for key in ("ys", "douts"):
            ref32[key] = [y.float() for y in ref32[key]]
        ref32["q"], ref32["g"] = ref32["q"].float(), ref32["g"].float()
        exact = grads_of(run_once(ref32, "torch"))
        got = grads_of(run_once(prob, variant, compiled=compiled, options=options))
        errs = [rel(a, b) for a, b in zip(got, exact)]
        if dtype == torch.bfloat16:
            ref_low = grads_of(run_once(prob, "torch"))
            ref_errs = [rel(a, b) for a, b in zip(ref_low, exact)]
            ok = all(e <= 2 * r + 1e-3 for e, r in zip(errs, ref_errs))
            out["bf16"] = dict(errors=errs, reference_errors=ref_errs, ok=ok)
        else:
            out["fp32"] = dict(errors=errs, ok=all(e <= 1e-4 for e in errs))
    return out


def time_variant(prob, variant, compiled, options, warmup, reps):
    for _ in range(warmup):
        run_once(prob, variant, compiled=compiled, options=options)
    if DEVICE == "cpu":  # smoke test only
        t0 = time.perf_counter()
        run_once(prob, variant, compiled=compiled, options=options)
        return (time.perf_counter() - t0) * 1e3, []
    return cuda_event_times(lambda leaves: run_once(prob, variant, leaves=leaves, compiled=compiled, options=options),
                            reps, prepare=lambda: fresh_leaves(prob))


def fresh_leaves(prob):
    return [y.detach().requires_grad_() for y in prob["ys"]] + [
        prob["q"].detach().requires_grad_(), prob["g"].detach().requires_grad_()]


def cuda_kernel_totals(fn, width=60):
    """(ms, launches) per CUDA kernel name (the first `width` characters) of one fn() under torch.profiler,
    as two Counters."""
    import collections

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals, counts = collections.Counter(), collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            totals[evt.name[:width]] += us / 1e3
            counts[evt.name[:width]] += 1
    return totals, counts


def cuda_event_times(fn, reps, prepare=lambda: None):
    """(median, all) of fn(prepare()) timed with CUDA events, prepare() outside the timed span."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        arg = prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def time_graphed(prob, options, warmup, reps):
    """The chunked Triton routing's forward + backward captured once in a CUDA graph and replayed: kernel time
    without the host's launch cost (what LanguageModel(cuda_graph=True) runs). Median of reps replays, all
    replay times, and the largest relative error of a replay on new input values against an eager run."""
    leaves = fresh_leaves(prob)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph requires
        for _ in range(warmup):
            run_once(prob, "triton", leaves=leaves, options=options)
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None  # the captured backward allocates the gradients in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_once(prob, "triton", leaves=leaves, options=options)
    graph.replay()
    result = cuda_event_times(lambda _: graph.replay(), reps)
    # Correctness of the captured path: new values in the captured inputs, one replay, against an eager run on
    # the same values (the same deterministic kernels: bitwise equal is expected)
    with torch.no_grad():
        for leaf in leaves:
            leaf.mul_(0.5).add_(torch.randn_like(leaf), alpha=0.25)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [x.clone() for x in grads_of(leaves)]
    eager = grads_of(run_once(prob, "triton", leaves=[x.detach().clone().requires_grad_() for x in leaves],
                              options=options))
    del graph
    return (*result, max(rel(a, b) for a, b in zip(replayed, eager)))


def copy_bandwidth():
    if DEVICE == "cpu":
        return 4.25e12
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)


def floor_ms(shape_name, bandwidth):
    d, L, H, B, T = SHAPES[shape_name]
    n = 2 * L + 1
    pairs = n * (n + 1) // 2
    return pairs * B * T * d * 2 / bandwidth * 1e3


def parse_grid(text):
    """FullRoutingConfig field dicts of a --grid text (see --grid's help)."""
    configs = []
    for entry_text in filter(None, text.split(";")):
        if "=" in entry_text:
            configs.append({k: int(v) if v.lstrip("-").isdigit() else v
                            for k, v in (kv.split("=") for kv in entry_text.split(","))})
        else:
            c, g, w, tile = (int(x) for x in entry_text.split(","))
            configs.append(dict(chunk=c, group=g, num_warps=w, tile_elements=tile))
    return configs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["100M", "350M", "1B"])
    parser.add_argument("--variants", nargs="+", default=["torch", "compile", "triton_percall", "triton"])
    parser.add_argument("--tune", action="store_true", help="also time a grid of chunk/group/warps/tile")
    parser.add_argument("--grid", default="8,4,2,2048;4,8,2,2048;8,8,2,2048;4,4,4,2048;4,8,2,4096;4,8,2,1024",
                        help="--tune grid: entries separated by ';', each 'chunk,group,warps,tile' or FullRoutingConfig "
                             "fields 'name=value,...' (e.g. 'prefix_unroll=2,suffix_tokens=4')")
    parser.add_argument("--graph", action="store_true",
                        help="also time every triton config captured in a CUDA graph (no host launch cost)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    import triton

    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth()
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke test)"
    print(f"device {device_name}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    compiled = None
    if "compile" in args.variants:
        from torch import _dynamo

        _dynamo.config.cache_size_limit = 256
        compiled = torch.compile(route_reference, dynamic=True)
    result = dict(device=device_name, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now().isoformat(timespec="seconds"),
                  command=" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
                  copy_bandwidth_TBps=bandwidth / 1e12, dtype="bfloat16", shapes={})
    date = datetime.date.today().isoformat()
    json_path = os.path.join(args.out, f"routing_h200_{date}.json")
    for shape_name in args.shapes:
        d, L, H, B, T = SHAPES[shape_name]
        entry = dict(d=d, L=L, H=H, B=B, T=T, sites=2 * L + 1, floor_ms=floor_ms(shape_name, bandwidth),
                     target_ms=TARGET_MS[shape_name], variants={})
        result["shapes"][shape_name] = entry
        print(f"\n== {shape_name}: d {d} L {L} H {H} B {B} T {T}; bandwidth floor (one forward read of every "
              f"routed source) {entry['floor_ms']:.2f} ms", flush=True)
        prob = make_problem(d, L, H, B, T, torch.bfloat16)
        configs = [("triton", {})]
        if args.tune and "triton" in args.variants:
            configs += [("triton", options) for options in parse_grid(args.grid)]
        # most important first: a run cut short by its time limit still leaves the triton numbers
        plan = (configs if "triton" in args.variants else []) + [(v, {}) for v in args.variants if v != "triton"]
        for variant, options in plan:
            label = variant + ("" if not options else " " + ",".join(f"{k}={v}" for k, v in options.items()))
            t0 = time.time()
            try:
                # torch is the reference itself; compile is checked against it only through the table
                checked = check(shape_name, variant, compiled, options) if variant.startswith("triton") else None
                warmup, reps = (1, 3) if variant == "torch" else (2, args.reps)
                ms, times = time_variant(prob, variant, compiled, options, warmup, reps)
                entry["variants"][label] = dict(ms=ms, times=times, check=checked)
                if args.graph and variant == "triton" and DEVICE == "cuda":
                    graph_ms, graph_times, graph_error = time_graphed(prob, options, warmup, args.reps)
                    entry["variants"][label].update(graph_ms=graph_ms, graph_times=graph_times,
                                                    graph_vs_eager=graph_error)
                    status_graph = f" graphed {graph_ms:.2f} ms (replay vs eager {graph_error:.0e})"
                else:
                    status_graph = ""
                status = "" if checked is None else (
                    f" check fp32 {max(checked['fp32']['errors']):.1e} bf16 {max(checked['bf16']['errors']):.1e}"
                    f" (ref {max(checked['bf16']['reference_errors']):.1e}) "
                    f"{'OK' if checked['fp32']['ok'] and checked['bf16']['ok'] else 'FAIL'}")
                print(f"{label:40s} {ms:9.2f} ms{status_graph}{status}  [{time.time() - t0:.0f}s]", flush=True)
            except torch.OutOfMemoryError as err:
                entry["variants"][label] = dict(ms=None, error=f"OOM: {str(err)[:200]}")
                print(f"{label:40s} OOM", flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
        del prob
    print("\n| shape | floor ms | " + " | ".join(args.variants) + " | best triton config | target |")
    for shape_name, entry in result["shapes"].items():
        cells = []
        for v in args.variants:
            ms = entry["variants"].get(v, {}).get("ms")
            cells.append("OOM" if ms is None else f"{ms:.2f}")
        tri = {k: e["ms"] for k, e in entry["variants"].items() if k.startswith("triton") and
               not k.startswith("triton_percall") and e.get("ms")}
        best = min(tri, key=tri.get) if tri else "-"
        best_ms = f"{tri[best]:.2f}" if tri else "-"
        graphed = {k: e["graph_ms"] for k, e in entry["variants"].items() if e.get("graph_ms")}
        best_graph = min(graphed, key=graphed.get) if graphed else None
        graph_cell = f" | graphed: {best_graph} {graphed[best_graph]:.2f}" if graphed else ""
        print(f"| {shape_name} | {entry['floor_ms']:.2f} | " + " | ".join(cells) +
              f" | {best} {best_ms}{graph_cell} | {entry['target_ms']} |")
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
