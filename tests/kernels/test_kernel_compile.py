"""Every full- and block-mode routing kernel, and full mode's decode kernels, compiles for an H100/H200 (sm_90)
with Triton's bundled ptxas, on this CPU machine: the interpreter runs the kernels' Python, not the compiler, so
errors such as a loop-carried variable that changes type or a tensor-core product shape the backend refuses only
show on a GPU otherwise
(benchmarks/compile_check.py; it runs in a subprocess because it needs TRITON_INTERPRET unset). All cases run in
one such process, each as its own `compile_check.py` call (its imports are most of a cached case's time)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL_CASES = [
    ["--dtype", "bf16"],
    ["--dtype", "fp32"],  # the fp32-storage paths (tf32x3 products)
    # the full-row column kernel with and without a suffix pass (the suffix with its key path), and the
    # software-pipelined prefix loop
    ["--dtype", "bf16", "column_impl=row", "group=8", "prefix_stages=3"],
    ["--dtype", "fp32", "column_impl=row", "group=8", "prefix_stages=3"],
]
BLOCK_CASES = [["--dtype", "bf16"], ["--dtype", "fp32", "stages=1"]]
DECODE_CASES = [["--dtype", "bf16"], ["--dtype", "fp32"]]  # full mode's decode router: prefill and decode step
# Runs compile_check.py's command line once per case in one process: its output, then a line with its exit status.
CASES_IN_ONE_PROCESS = """
import json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv = ["compile_check.py", *argv]
    try:
        runpy.run_path("benchmarks/compile_check.py", run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
        if not isinstance(code, int):  # sys.exit(message): shown, and status 1, as at a process's exit
            print(code)
            code = 1
    print(f"{END} {code}", flush=True)
"""
END = "@@ compile_check exit status"


def _compile_each(cases: list[list[str]]) -> list[tuple[int, str]]:
    """(exit status, output) of compile_check.py for each case."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CASES_IN_ONE_PROCESS.replace("{END}", END), json.dumps(cases)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    results, lines = [], []
    for line in done.stdout.splitlines():
        if line.startswith(END):
            results.append((int(line[len(END):]), "\n".join(lines)))
            lines = []
        else:
            lines.append(line)
    assert done.returncode == 0 and len(results) == len(cases), done.stdout[-3000:] + done.stderr[-3000:]
    return results


def test_full_and_block_routing_kernels_compile_for_sm90():
    full = [["--shapes", "tiny", *args] for args in FULL_CASES]
    block = [["--mode", "block", "--shapes", "tiny", *args] for args in BLOCK_CASES]
    decode = [["--mode", "decode", "--shapes", "tiny", *args] for args in DECODE_CASES]
    results = _compile_each(full + block + decode)
    for args, (code, out) in zip(FULL_CASES, results):
        assert code == 0, f"{args}: {out[-3000:]}"
        assert "0 failed" in out and "_suffix" in out and "_prefix" in out, f"{args}: {out}"
        if "column_impl=row" in args:
            rows = [line for line in out.splitlines() if "_column_row_bwd_kernel" in line]
            assert {"'HAS_SUFFIX': True" in line for line in rows} == {True, False}, f"{args}: {out}"
            suffix = [line for line in out.splitlines() if "_suffix_dot_bwd_kernel" in line]
            assert suffix and all("'KEYPATH': True" in line for line in suffix), f"{args}: {out}"
            prefix = [line for line in out.splitlines() if "_prefix_fwd_kernel" in line]
            assert prefix and all("'STAGES': 3" in line and "async copies 0" not in line for line in prefix), (
                f"{args}: {out}")
    for args, (code, out) in zip(DECODE_CASES, results[len(FULL_CASES) + len(BLOCK_CASES):]):
        assert code == 0 and "0 failed" in out, f"{args}: {out[-3000:]}"
        assert "_add_kernel" in out and "'HAS_G': False" in out and "'HAS_G': True" in out, f"{args}: {out}"
    for args, (code, out) in zip(BLOCK_CASES, results[len(FULL_CASES):]):
        assert code == 0, f"{args}: {out[-3000:]}"
        assert "0 failed" in out, f"{args}: {out}"
        kernels = ("_block_fwd", "_block_site_bwd", "_block_pass_bwd", "_block_query_grad")
        assert all(name in out for name in kernels), f"{args}: {out}"
