"""Host cost of one Triton launch with a routing kernel's argument list (7 pointers, 9 ints, 5 constexprs):
the usual `kernel[grid](...)` path against the compiled kernel's own launcher and mhar_lit's fast path,
plus the host cost of the small torch calls a routing site makes (torch.empty, an autograd.Function apply)
and of the per-call routing's torch.library custom op (mhar_lit::route) against its implementation called
directly, on a tiny problem whose kernel time is negligible (forward only, then with autograd recording).
Host microseconds per call, median of 5 runs of 2000 calls each, the GPU kept idle (the kernel does nothing).

    python benchmarks/launch_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from mhar_lit.kernels.launch import launch


@triton.jit(do_not_specialize=["a", "b", "c"])
def _noop(p0, p1, p2, p3, p4, p5, p6, a, b, c, N, P, D, H, K, e,
          X: tl.constexpr, Y: tl.constexpr, Z: tl.constexpr, W: tl.constexpr, ACC: tl.constexpr):
    if tl.program_id(0) < 0:  # never true: the launch is the whole cost
        tl.store(p0, tl.load(p1))


def host_us(fn, calls: int = 2000, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def custom_op_rows():
    """Host cost of the per-call routing (3 sources of 16 tokens x 64, 4 heads, bf16): the custom op against its
    implementation, and route_triton (checks, then the eager autograd.Function outside torch.compile)."""
    from mhar_lit.kernels.routing_triton import _route_impl, _route_op, route_triton

    src = torch.randn(3, 1, 16, 64, device="cuda").to(torch.bfloat16)
    src_g = src.clone().requires_grad_(True)
    q, g = torch.randn(64, device="cuda"), torch.ones(64, device="cuda")
    rows = src.view(3, 16, 64)
    return [
        ("per-call routing implementation called directly (no custom op)", lambda: _route_impl(rows, q, g, 4, 1e-6)),
        ("per-call routing through the custom op mhar_lit::route", lambda: _route_op(src, q, g, 4, 1e-6)),
        ("route_triton, sources that need gradients (eager: autograd.Function, no op)",
         lambda: route_triton(src_g, q, g, 4)),
        ("route_triton, sources without gradients (eager)", lambda: route_triton(src, q, g, 4)),
    ]


def main() -> None:
    ptrs = [torch.empty(16, device="cuda") for _ in range(7)]
    ints = (5, 17, 3, 73, 2048, 1280, 8, 160, 7)
    consts = dict(X=8, Y=2, Z=256, W=16, ACC=tl.float32)
    grid = (1024, 8)
    compiled = _noop[grid](*ptrs, *ints, **consts)  # Triton returns the compiled kernel it launched
    runner = compiled[grid + (1,)]  # the compiled kernel's launcher reads grid[0..2]
    x = torch.empty(2048, 1280, device="cuda", requires_grad=True)
    stream = torch.cuda.current_stream().cuda_stream
    run = compiled.run  # the C launcher itself: the floor of any Python-side launch path
    direct = lambda: run(*grid, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,  # noqa: E731
                         *ptrs, *ints, *consts.values())
    rows = [
        ("kernel[grid](...) (Triton's usual launch)", lambda: _noop[grid](*ptrs, *ints, **consts)),
        ("compiled kernel's launcher (all args, constexprs too)", lambda: runner(*ptrs, *ints, *consts.values())),
        ("compiled kernel's C launcher called directly", direct),
        ("mhar_lit launch(), key from the arguments", lambda: launch(_noop, grid, *ptrs, *ints, num_warps=4,
                                                                     **consts)),
        ("mhar_lit launch(), caller's key (FullRouting)", lambda: launch(_noop, grid, *ptrs, *ints, num_warps=4,
                                                                         key=("site",), **consts)),
        ("torch.empty(2048 x 1280, bf16)", lambda: torch.empty(2048, 1280, dtype=torch.bfloat16, device="cuda")),
        ("autograd.Function.apply (view)", lambda: _Identity.apply(x)),
        *custom_op_rows(),
    ]
    print(f"torch {torch.__version__}  triton {triton.__version__}  {torch.cuda.get_device_name()}")
    from triton import knobs

    from mhar_lit.kernels import launch as fast
    print(f"  fast launch enabled: {fast.fast_launch_enabled()} (env {fast.ENABLED}, hooks "
          f"{knobs.runtime.launch_enter_hook!r} / {knobs.runtime.launch_exit_hook!r}); Triton returned "
          f"{type(compiled).__name__}; arg_names {getattr(_noop, 'arg_names', None)}")
    for name, fn in rows:
        try:  # the launcher's calling convention differs between Triton versions
            print(f"  {host_us(fn):7.2f} us  {name}  (kept kernels: {len(fast._compiled)})")
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"  failed: {type(err).__name__}: {str(err)[:150]}  {name}")


if __name__ == "__main__":
    main()
