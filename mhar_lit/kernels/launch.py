"""A cheaper host path for launching the routing kernels.

Triton's `kernel[grid](*args)` binds the arguments, computes their specialisation and hashes a cache key on
every call: 17-28 us of host time per launch on the H200 machines (benchmarks/launch_overhead.py), while
full-mode routing makes a hundred or more launches per pass (one per site and kernel) at the paper's shapes.
`launch` keeps the compiled kernel that Triton returns from its first launch and calls its launcher directly
afterwards.

What identifies a kept kernel:
- `key=None`: a key computed from the arguments that covers everything Triton specialises on (`_arg_key`:
  a tensor's dtype and 16-byte alignment, an int's value class unless the kernel does not specialise it).
  A key finer than Triton's only costs one more ordinary launch; it never picks a kernel compiled for other
  arguments. Computing it costs a few microseconds.
- `key=(...)`: the caller's own key, for hot call sites whose arguments it knows (FullRouting: its shape,
  dtypes and knobs, the alignment of tensors it did not allocate); the constexprs and num_warps are added
  to it here. Cheaper, and checked: with AUDIT on (MHAR_FAST_LAUNCH_AUDIT=1, the CPU tests) every
  launch also computes the argument key and raises if one caller key ever meets two argument keys.

The ordinary path is used under the interpreter, while a Triton launch hook is installed (profilers such as
proton rely on it), and when MHAR_FAST_LAUNCH=0 (both variables are read at import).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch


def env_enabled(environ: Mapping[str, str]) -> bool:
    return environ.get("TRITON_INTERPRET", "0") != "1" and environ.get("MHAR_FAST_LAUNCH", "1") != "0"


ENABLED = env_enabled(os.environ)
AUDIT = os.environ.get("MHAR_FAST_LAUNCH_AUDIT", "0") == "1"
_I32 = (-(2 ** 31), 2 ** 31)
_compiled: dict[tuple, tuple[Any, Any, tuple[str, ...]]] = {}
_audited: dict[tuple, tuple] = {}
_unspecialised_names: dict[Any, frozenset] = {}


def no_hook(hook: Any) -> bool:
    """Whether a Triton launch hook slot is empty: None (older Triton) or a HookChain without calls (3.5+,
    where the slots are never None)."""
    return hook is None or getattr(hook, "calls", None) == []


_runtime_knobs = None


def fast_launch_enabled() -> bool:
    global _runtime_knobs
    if not ENABLED:
        return False
    if _runtime_knobs is None:  # imported once, not on every launch (Triton >= 3.4)
        from triton import knobs
        _runtime_knobs = knobs.runtime
    return no_hook(_runtime_knobs.launch_enter_hook) and no_hook(_runtime_knobs.launch_exit_hook)


def _unspecialised(kernel) -> frozenset:
    """Names of the kernel's do_not_specialize arguments (JIT kernels and the interpreter's wrappers)."""
    names = _unspecialised_names.get(kernel)
    if names is None:
        if hasattr(kernel, "params"):
            names = frozenset(p.name for p in kernel.params if p.do_not_specialize)
        else:
            names = frozenset(getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())
        _unspecialised_names[kernel] = names
    return names


def _arg_key(a: Any, specialise: bool = True) -> Any:
    """What Triton specialises on for one argument: a tensor's dtype and 16-byte alignment, an int's value
    class (== 1, divisible by 16; only its width when not specialised); constexpr-like values by value."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        wide = not _I32[0] <= a < _I32[1]
        return (a == 1, a % 16 == 0, wide) if specialise else wide
    if isinstance(a, float):
        return "f"
    return a


def argument_key(kernel, num_warps: int, args: tuple, constexprs: dict) -> tuple:
    skip = _unspecialised(kernel)
    names = kernel.arg_names
    return (num_warps, *constexprs.items(),
            *(_arg_key(a, names[i] not in skip) for i, a in enumerate(args)))


def _caller_key(kernel, num_warps: int, key: tuple, constexprs: dict) -> tuple:
    """A caller's key completed with what changes between its launches: num_warps and the constexprs."""
    return (kernel, num_warps, key, *constexprs.values())


def _audit(kernel, key: tuple, num_warps: int, args: tuple, constexprs: dict) -> None:
    full = argument_key(kernel, num_warps, args, constexprs)
    seen = _audited.setdefault(_caller_key(kernel, num_warps, key, constexprs), full)
    if seen != full:
        raise RuntimeError(f"fast launch: caller key {key} of {getattr(kernel, '__name__', kernel)} met two "
                           f"argument specialisations:\n  {seen}\n  {full}\nthe key misses something Triton "
                           "specialises on (set MHAR_FAST_LAUNCH=0 to launch the ordinary way)")


def launch(kernel, grid: tuple, *args: Any, num_warps: int, key: tuple | None = None, **constexprs: Any) -> None:
    """`kernel[grid](*args, num_warps=num_warps, **constexprs)`, without Triton's per-call binding once this
    specialisation has been launched before. `args` are the runtime arguments in signature order,
    `constexprs` the compile-time ones (by name); `key` see the module docstring."""
    if AUDIT and key is not None:
        _audit(kernel, key, num_warps, args, constexprs)
    if not fast_launch_enabled():
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    device = torch.cuda.current_device()
    if key is None:
        full_key = (kernel, device, argument_key(kernel, num_warps, args, constexprs))
    else:
        full_key = (device, *_caller_key(kernel, num_warps, key, constexprs))
    entry = _compiled.get(full_key)
    if entry is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
        names = tuple(kernel.arg_names[len(args):])
        if compiled is not None and sorted(names) == sorted(constexprs):
            compiled._init_handles()
            _compiled[full_key] = (compiled, compiled.run, names)
        return
    compiled, run, names = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = _raw_stream(device)
    # the launcher takes every argument in signature order, constexprs included (it skips those)
    run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *args, *(constexprs[n] for n in names))


def _raw_stream(device: int) -> int:
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's own launch path calls
    return get(device) if get is not None else torch.cuda.current_stream(device).cuda_stream


def clear_cache() -> None:
    """Forget every kept kernel (they stay in Triton's own cache) and every audit record."""
    _compiled.clear()
    _audited.clear()
