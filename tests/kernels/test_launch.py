"""The fast launch path (mhar_lit.kernels.launch) with a stand-in for a Triton kernel: which launches go
through Triton's binding, which reuse a kept compiled kernel, and with which arguments; the audit of caller
keys. On a GPU the same path is exercised by every routing benchmark, whose correctness checks run before
timing."""

import pytest
import torch

from mhar_lit.kernels import launch as fast


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, calls):
        self.calls = calls

    def _init_handles(self):
        pass

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        self.calls.append(("compiled", (g0, g1, g2), args))


class _Param:
    def __init__(self, name, do_not_specialize=False):
        self.name, self.do_not_specialize = name, do_not_specialize


class _FakeKernel:
    """Signature (x_ptr, n, row, eps, BLOCK, ACC), `row` not specialised: `kernel[grid](...)` records the call
    and returns a compiled kernel."""
    arg_names = ["x_ptr", "n", "row", "eps", "BLOCK", "ACC"]
    params = [_Param(n, n == "row") for n in arg_names]

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
    monkeypatch.setattr(fast, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fast.clear_cache()
    yield _FakeKernel()
    fast.clear_cache()


def _launch(kernel, x, n=37, row=5, num_warps=4, block=16, key=None, grid=(4, 2)):
    fast.launch(kernel, grid, x, n, row, 1e-6, num_warps=num_warps, key=key, BLOCK=block, ACC="fp32")


def test_second_launch_of_a_specialisation_skips_triton_binding(kernel):
    x = torch.zeros(64)
    _launch(kernel, x)
    fast.launch(kernel, (5, 2), x, 38, 1, 1e-5, num_warps=4, BLOCK=16, ACC="fp32")  # row 1: not specialised
    assert [c[0] for c in kernel.calls] == ["triton", "compiled"]
    # the kept kernel gets every argument in signature order (constexprs last) and a 3-D grid
    assert kernel.calls[1][1:] == ((5, 2, 1), (x, 38, 1, 1e-5, 16, "fp32"))


@pytest.mark.parametrize("change", [
    dict(n=1),             # Triton turns an int equal to 1 into a constant
    dict(n=48),            # ... and marks ints divisible by 16
    dict(n=2 ** 31),       # ... and widens ints past 32 bits
    dict(row=2 ** 31),     # ... even ints it does not specialise
    dict(x=torch.zeros(64)[1:]),  # a pointer that is not 16-byte aligned
    dict(x=torch.zeros(64, dtype=torch.float64)),
    dict(block=32),
    dict(num_warps=8),
])
def test_anything_triton_specialises_on_takes_the_ordinary_path(kernel, change):
    args = dict(x=torch.zeros(64))
    _launch(kernel, **args)
    args.update(change)
    _launch(kernel, **args)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]


def test_caller_key_reuses_and_audit_catches_a_key_that_misses_something(kernel, monkeypatch):
    x = torch.zeros(64)
    _launch(kernel, x, key=("site",))
    _launch(kernel, x, n=38, key=("site",))
    assert [c[0] for c in kernel.calls] == ["triton", "compiled"]
    _launch(kernel, x, block=32, key=("site",))  # constexprs and num_warps are part of every key
    assert kernel.calls[-1][0] == "triton"
    monkeypatch.setattr(fast, "AUDIT", True)
    _launch(kernel, x, key=("audited",))
    _launch(kernel, x, n=39, row=1, key=("audited",))  # same specialisation: fine
    with pytest.raises(RuntimeError, match="misses something Triton specialises on"):
        _launch(kernel, torch.zeros(64)[1:], key=("audited",))  # the key ignores the alignment


def test_interpreter_and_opt_out_use_the_ordinary_path():
    assert fast.env_enabled({})
    assert not fast.env_enabled({"TRITON_INTERPRET": "1"})
    assert not fast.env_enabled({"MHAR_FAST_LAUNCH": "0"})


def test_an_installed_launch_hook_is_seen():
    """Triton >= 3.5 keeps HookChain objects in its hook slots, never None: empty chains are no hook, a chain
    with a call (a profiler) or a plain callable is one."""
    assert fast.no_hook(None)
    assert not fast.no_hook(lambda *args: None)
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.HookChain()
    assert fast.no_hook(chain)
    chain.add(lambda *args: None)
    assert not fast.no_hook(chain)
    assert fast.no_hook(knobs.runtime.launch_enter_hook) and fast.no_hook(knobs.runtime.launch_exit_hook)
