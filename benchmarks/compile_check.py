"""Compile every kernel that a FullRouting (or, with --mode block, BlockRouting) forward + backward launches, or
(--mode decode) full mode's decode router a prefill and a decode step launch, for a GPU target, on a machine
without one: the launches are recorded instead of run (on CPU tensors whose values are never read), then
each distinct kernel configuration is compiled to a cubin with Triton's bundled ptxas. This catches the
compile errors that the interpreter does not (a loop-carried variable that changes type, a product shape
the tensor cores refuse) before any GPU time is spent, and reports registers, spill stack, shared memory and
the number of asynchronous-copy instructions (nonzero where Triton software-pipelined a loop's loads) per kernel.

    python benchmarks/compile_check.py [--shapes 100M 350M 1B] [--dtype bf16|fp32] [--arch 90]
                                       [--mode full|block|decode] [--sass DIR] [knob=value ...]  (fields of the mode's
                                                                   kernel config, e.g. column_impl=row)

Run without TRITON_INTERPRET (the interpreter replaces the kernels). Exit status 1 if any kernel fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("compile_check.py compiles real kernels: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mhar_lit.kernels.block_routing as block_routing  # noqa: E402
import mhar_lit.kernels.full_routing as full_routing  # noqa: E402
from mhar_lit.kernels import block, decode_routing, full_backward, full_forward, host  # noqa: E402

SHAPES = {  # name: (B, T, d, sites, H), as benchmarks/routing.py
    "100M": (8, 2048, 512, 25, 8),
    "350M": (4, 1024, 1024, 49, 8),
    "1B": (2, 1024, 1280, 73, 8),
    "tiny": (1, 64, 480, 21, 3),  # K = 160: the suffix pass splits it as 128 + 32
}
BLOCK_SPAN = {"100M": 4, "350M": 6, "1B": 12, "tiny": 4}  # sites per block (benchmarks/train_step.py)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_TYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64", torch.int64: "i64"}


def record_launches(shape_name, dtype, knobs, mode="full"):
    """(kernel, args, constexprs, num_warps) of every launch of one forward + backward, nothing run."""
    b, t, d, n, heads = SHAPES[shape_name]
    kernel_modules = {"full": (full_forward, full_backward), "block": (block,), "decode": (decode_routing,)}[mode]
    calls = []

    class Recorder:  # stands in for a kernel: kernel[grid](*args, **constexprs) records instead of launching
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def record(*args, num_warps=4, **constexprs):
                calls.append((self.kernel, args, constexprs, num_warps))
            return record

    saved = [(m, name, kernel) for m in kernel_modules for name, kernel in vars(m).items()
             if isinstance(kernel, triton.runtime.jit.JITFunction) and name.endswith("_kernel")]
    saved_check = host.check_device
    for m, name, kernel in saved:
        setattr(m, name, Recorder(kernel))
    host.check_device = lambda *tensors: None
    try:
        emb = torch.zeros(b, t, d, dtype=dtype, requires_grad=True)
        q = torch.zeros(n, d, requires_grad=True)
        g = torch.ones(n, d, requires_grad=True)
        if mode == "decode":
            _record_decode(emb, q, g, heads)
            return calls
        if mode == "full":
            routing = full_routing.FullRouting(emb, q, g, heads, config=knobs)
        else:
            routing = block_routing.BlockRouting(emb, q, g, heads, BLOCK_SPAN[shape_name], config=knobs)
        x = emb
        for s in range(n):
            x = routing.route(s, emb if s == 0 else x * 1.0, *((q, g) if s == 0 else (None, None)))
        x.float().sum().backward()
    finally:
        for m, name, kernel in saved:
            setattr(m, name, kernel)
        host.check_device = saved_check
    return calls


def _record_decode(emb, q, g, heads):
    """A prefill of emb's [B, T] tokens and a decode step of B tokens through DecodeFullRouter's kernels, and a
    call of DecodeCallRouter's (its query times the key-norm weight taken in the kernel)."""
    from mhar_lit.generation.routing import DecodeCallRouter, DecodeFullRouter

    router = DecodeFullRouter(heads, 1e-6, kernels=True)
    with torch.no_grad():
        for x in (emb.detach(), emb.detach()[:, :1]):
            state = router.begin(x, q.detach(), g.detach())
            for s in range(q.shape[0]):
                out = router.route(state, s)
                if s + 1 < q.shape[0]:
                    router.add(state, out)
        x = emb.detach()[:, :1]
        DecodeCallRouter(heads, 1e-6, kernels=True).route([x, x * 2], q.detach()[0], g.detach()[0])


def _signature(kernel, args, constexprs):
    """Triton's signature and specialisation attributes for these arguments, as a GPU launch would give
    (16-byte aligned pointers; ints divisible by 16 marked so, except do_not_specialize ones)."""
    sig, attrs = {}, {}
    for i, (name, a) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPE_NAMES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} of type {type(a).__name__}")
        specialised = i not in kernel.do_not_specialize and name not in kernel.do_not_specialize
        if specialised and (isinstance(a, torch.Tensor) or (type(a) is int and a % 16 == 0)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, attrs


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump run on a cubin (-res-usage: registers and stack; -sass: the machine code)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def _usage(cubin: bytes) -> str:
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", _cuobjdump(cubin, "-res-usage"))
    return f"regs {m.group(1)} spill stack {m.group(2)}" if m else "usage unknown"


def compile_all(shape_names, dtype, knobs, arch=90, mode="full", sass_dir=None):
    """Compile each distinct kernel configuration (with sass_dir, write each one's SASS there); returns the
    number of failures."""
    target = GPUTarget("cuda", arch, 32)
    seen, failures = set(), 0
    for shape_name in shape_names:
        for kernel, args, constexprs, warps in record_launches(shape_name, dtype, knobs, mode):
            sig, attrs = _signature(kernel, args, constexprs)
            key = (kernel.__name__, tuple(sig.items()), tuple(attrs), tuple(constexprs.items()), warps)
            if key in seen:
                continue
            seen.add(key)
            shown = {k: v for k, v in constexprs.items() if k not in ("ACC", "PREC")}
            label = f"{shape_name:5s} {kernel.__name__:24s} warps {warps} {shown}"
            try:
                compiled = triton_compile(ASTSource(kernel, sig, constexprs, attrs), target=target,
                                          options=dict(num_warps=warps))
                shared = getattr(compiled.metadata, "shared", "?")
                ptx = compiled.asm.get("ptx", "")
                asyncs = ptx.count("cp.async.ca") + ptx.count("cp.async.cg") + ptx.count("cp.async.bulk")
                # global loads by width: 16-byte (v4 of 32 bit), 8-byte (v2) and the rest (a pointer the compiler
                # cannot prove aligned gets narrow loads)
                loads = re.findall(r"ld\.global(?:\.\w+)*?(\.v[24])?\.[bfsu](?:8|16|32|64)\b", ptx)
                widths = f"loads v4 {loads.count('.v4')} v2 {loads.count('.v2')} other {loads.count('')}"
                if sass_dir:
                    os.makedirs(sass_dir, exist_ok=True)
                    stem = os.path.join(sass_dir, f"{shape_name}_{kernel.__name__}_{len(seen)}")
                    with open(stem + ".sass", "w") as f:
                        f.write(_cuobjdump(compiled.asm["cubin"], "-sass"))
                    with open(stem + ".ttgir", "w") as f:  # the layouts and their conversions
                        f.write(compiled.asm["ttgir"])
                print(f"{label}  {_usage(compiled.asm['cubin'])} smem {shared} async copies {asyncs} {widths}",
                      flush=True)
            except Exception as err:  # report every failing configuration, not only the first
                failures += 1
                cause = f" (cause: {err.__cause__!r})" if err.__cause__ is not None else ""
                print(f"{label}  FAILED: {str(err)[-800:]}{cause}", flush=True)
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["100M", "350M", "1B"], choices=list(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    parser.add_argument("--mode", default="full", choices=["full", "block", "decode"])
    parser.add_argument("--sass", metavar="DIR",
                        help="write each kernel configuration's SASS (cuobjdump) and TTGIR into DIR")
    parser.add_argument("knobs", nargs="*", help="FullRoutingConfig / BlockRoutingConfig fields name=value")
    args = parser.parse_args()
    knobs = {}
    for item in args.knobs:
        name, _, value = item.partition("=")
        knobs[name] = int(value) if value.lstrip("-").isdigit() else value
    failures = compile_all(args.shapes, DTYPES[args.dtype], knobs, args.arch, args.mode, args.sass)
    print(f"{failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
