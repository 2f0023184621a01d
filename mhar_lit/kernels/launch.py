"""A cheaper host path for launching the routing kernels.

Triton's `kernel[grid](*args)` binds the arguments, computes their specialisation and hashes a cache key on
every call: about 17 us of host time per launch on the H200's host (benchmarks/launch_overhead.py), while a
full-mode routing pass makes ~400 launches per microbatch at 1B. `launch` keeps the compiled kernel that
Triton returns from its first launch, under a key of our own that covers everything Triton specialises on
(see `_arg_key`), and launches it directly afterwards. A key that is finer than Triton's only costs one more
ordinary launch; it can never pick a kernel compiled for other arguments.

The ordinary path is used under the interpreter, while a Triton launch hook is installed (profilers such as
proton rely on it), and whenever MHAR_FAST_LAUNCH=0.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_I32 = (-(2 ** 31), 2 ** 31)
_compiled: dict[tuple, tuple[Any, tuple[str, ...]]] = {}


def fast_launch_enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get("MHAR_FAST_LAUNCH", "1") == "0":
        return False
    try:
        from triton import knobs  # lazy: only needed on a GPU launch (Triton >= 3.4)
    except ImportError:
        return False
    return knobs.runtime.launch_enter_hook is None and knobs.runtime.launch_exit_hook is None


def _arg_key(a: Any) -> Any:
    """What Triton specialises on for one argument: a tensor's dtype and 16-byte alignment, an int's value
    class (== 1, divisible by 16, 32-bit range); constexpr-like values by value."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, _I32[0] <= a < _I32[1]
    if isinstance(a, float):
        return "f"
    return a


def launch(kernel, grid: tuple, *args: Any, num_warps: int, **constexprs: Any) -> None:
    """`kernel[grid](*args, num_warps=num_warps, **constexprs)`, without Triton's per-call binding once this
    specialisation has been launched before. `args` are the runtime arguments in signature order,
    `constexprs` the compile-time ones (by name)."""
    if not fast_launch_enabled():
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    key = (kernel, num_warps, torch.cuda.current_device(), *constexprs.items(), *map(_arg_key, args))
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
        names = tuple(kernel.arg_names[len(args):])
        if compiled is not None and sorted(names) == sorted(constexprs):
            _compiled[key] = (compiled, names)
        return
    compiled, names = entry
    compiled[grid3](*args, *(constexprs[n] for n in names))


def clear_cache() -> None:
    """Forget every kept kernel (they stay in Triton's own cache)."""
    _compiled.clear()
