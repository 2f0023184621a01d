"""Every full- and block-mode routing kernel compiles for an H100/H200 (sm_90) with Triton's bundled ptxas, on this
CPU machine: the interpreter runs the kernels' Python, not the compiler, so errors such as a loop-carried
variable that changes type or a tensor-core product shape the backend refuses only show on a GPU otherwise
(benchmarks/compile_check.py; it runs in a subprocess because it needs TRITON_INTERPRET unset)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("args", [
    ["--dtype", "bf16"],
    ["--dtype", "fp32"],  # the fp32-storage paths (tf32x3 products)
    # the full-row column kernel with and without a suffix pass (the suffix with its key path), and the
    # software-pipelined prefix loop
    ["--dtype", "bf16", "column_impl=row", "group=8", "prefix_stages=3"],
    ["--dtype", "fp32", "column_impl=row", "group=8", "prefix_stages=3"],
])
def test_full_routing_kernels_compile_for_sm90(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_check.py"), "--shapes", "tiny",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 failed" in done.stdout and "_suffix" in done.stdout and "_prefix" in done.stdout, done.stdout
    if "column_impl=row" in args:
        rows = [line for line in done.stdout.splitlines() if "_column_row_bwd_kernel" in line]
        assert {"'HAS_SUFFIX': True" in line for line in rows} == {True, False}, done.stdout
        suffix = [line for line in done.stdout.splitlines() if "_suffix_dot_bwd_kernel" in line]
        assert suffix and all("'KEYPATH': True" in line for line in suffix), done.stdout
        prefix = [line for line in done.stdout.splitlines() if "_prefix_fwd_kernel" in line]
        assert prefix and all("'STAGES': 3" in line and "async copies 0" not in line for line in prefix), done.stdout


@pytest.mark.parametrize("dtype,knobs", [("bf16", []), ("fp32", ["stages=1"])])
def test_block_routing_kernels_compile_for_sm90(dtype, knobs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_check.py"), "--mode", "block",
                           "--shapes", "tiny", "--dtype", dtype, *knobs], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 failed" in done.stdout, done.stdout
    kernels = ("_block_fwd", "_block_site_bwd", "_block_pass_bwd", "_block_query_grad")
    assert all(name in done.stdout for name in kernels), done.stdout
