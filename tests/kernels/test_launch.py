"""The fast launch path (mhar_lit.kernels.launch) with a stand-in for a Triton kernel: which launches go
through Triton's binding, which reuse a kept compiled kernel, and with which arguments. On a GPU the same
path is exercised by every routing benchmark, whose correctness checks run before timing."""

import pytest
import torch

from mhar_lit.kernels import launch as fast


class _FakeCompiled:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("compiled", grid, args))


class _FakeKernel:
    """Signature (x_ptr, n, eps, BLOCK, ACC): `kernel[grid](...)` records the call and returns a compiled one."""
    arg_names = ["x_ptr", "n", "eps", "BLOCK", "ACC"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, num_warps, **constexprs):
            self.calls.append(("triton", grid, args, num_warps, constexprs))
            return _FakeCompiled(self.calls)
        return run


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(fast, "fast_launch_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fast.clear_cache()
    yield _FakeKernel()
    fast.clear_cache()


def test_second_launch_of_a_specialisation_skips_triton_binding(kernel):
    x = torch.zeros(64)
    fast.launch(kernel, (4, 2), x, 37, 1e-6, num_warps=4, BLOCK=16, ACC="fp32")
    fast.launch(kernel, (5, 2), x, 38, 1e-5, num_warps=4, BLOCK=16, ACC="fp32")
    assert [c[0] for c in kernel.calls] == ["triton", "compiled"]
    # the kept kernel gets every argument in signature order (constexprs last) and a 3-D grid
    assert kernel.calls[1][1:] == ((5, 2, 1), (x, 38, 1e-5, 16, "fp32"))


@pytest.mark.parametrize("change", [
    dict(n=1),             # Triton turns an int equal to 1 into a constant
    dict(n=48),            # ... and marks ints divisible by 16
    dict(n=2 ** 31),       # ... and widens ints past 32 bits
    dict(x=torch.zeros(64)[1:]),  # a pointer that is not 16-byte aligned
    dict(x=torch.zeros(64, dtype=torch.float64)),
    dict(BLOCK=32),
    dict(num_warps=8),
])
def test_anything_triton_specialises_on_takes_the_ordinary_path(kernel, change):
    args = dict(x=torch.zeros(64), n=37, BLOCK=16, num_warps=4)
    fast.launch(kernel, (4,), args["x"], args["n"], 1e-6, num_warps=args["num_warps"], BLOCK=args["BLOCK"],
                ACC="fp32")
    args.update(change)
    fast.launch(kernel, (4,), args["x"], args["n"], 1e-6, num_warps=args["num_warps"], BLOCK=args["BLOCK"],
                ACC="fp32")
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]


def test_interpreter_and_opt_out_use_the_ordinary_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fast.fast_launch_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("MHAR_FAST_LAUNCH", "0")
    assert not fast.fast_launch_enabled()
