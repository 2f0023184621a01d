"""Triton's interpreter without its repeated set-up inside a launch, and with two look-ups it repeats done once
(tests only; the kernels' code paths unchanged).

A kernel launch in the interpreter (TRITON_INTERPRET=1) first replaces triton.language's builtins with
interpreted ones (`_patch_lang`), runs every program of the grid, then restores them. Each call of a @triton.jit
helper inside the kernel calls `_patch_lang` again, once per program and call site: it walks every member of
triton.language, finds them already replaced and sets the same replacements again (it never restores them; the
launch's own restore does). Here a helper's call skips it when the running launch already replaced the language
modules the helper sees; anything else goes to Triton's own `_patch_lang`. Measured 2026-12-07 on 2 cores
(Triton 3.8): test_unroll_and_tiling_change_nothing 31.7 s -> 24.2 s, the two float64 gradchecks of full mode
107 s -> 87 s; outputs and gradients of full and block mode bitwise equal with and without it.
"""

import inspect


def _replace_in_interpreter(name: str, build) -> bool:
    """Replace triton.runtime.interpreter.<name> with build(original), once (the replacement is marked). False
    (nothing changed) where Triton or that function is missing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, name, None)
    if original is None or getattr(original, "mhar_lit_replacement", False):
        return original is not None
    replacement = build(original)
    replacement.mhar_lit_replacement = True
    setattr(interpreter, name, replacement)
    return True


def patch_lang_once_per_launch() -> bool:
    """Install the shortcut; False (nothing changed) where this Triton's interpreter lacks the hook it wraps."""
    return _replace_in_interpreter("_patch_lang", _patch_lang_once_per_launch)


def _patch_lang_once_per_launch(original):
    import triton.language as tl

    active = []  # the lang modules the running launch replaced (one set while a launch runs)
    langs_of = {}  # jit function -> the lang modules in its globals, as _patch_lang collects them

    class _AlreadyPatched:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in [tl, tl.core])
        if active and langs and langs <= active[0]:
            return _AlreadyPatched()
        scope = original(fn)
        if active:  # a helper seeing another lang module: Triton leaves it replaced until the launch ends too
            active[0] = active[0] | langs
            return scope
        active.append(langs)
        restore = scope.restore

        def restore_and_end_launch() -> None:
            active.clear()
            restore()

        scope.restore = restore_and_end_launch
        return scope

    return patch_lang


def numpy_dtypes_from_one_table() -> bool:
    """The interpreter maps a Triton dtype to the numpy dtype that holds it (`_get_np_dtype`) several times per
    operation, rebuilding its 19-entry table on every call (~9% of a kernel test's time); here the same mapping
    reads one table built once. False (nothing changed) where this Triton's interpreter lacks the function."""
    return _replace_in_interpreter("_get_np_dtype", _np_dtype_from_one_table)


def _np_dtype_from_one_table(original):
    import triton.language as tl

    pointer = original(tl.pointer_type(tl.int8))
    table = {}  # every scalar dtype triton.language names that the interpreter maps
    for dtype in vars(tl.core).values():
        if isinstance(dtype, tl.dtype) and not isinstance(dtype, (tl.pointer_type, tl.block_type)):
            try:
                table[dtype] = original(dtype)
            except KeyError:  # not mapped by the interpreter (e.g. void): a KeyError from either version
                pass

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            element = tt_dtype.element_ty
            return pointer if isinstance(element, tl.pointer_type) else table[element]
        return table[tt_dtype]

    return get_np_dtype


def builtin_lists_found_once() -> bool:
    """Each launch's `_patch_lang` replaces the builtins of triton.language, its tensor class, math and
    tensor_descriptor_base, finding them by walking every member of each (`inspect.getmembers`, ~5% of a kernel
    test's time). Here each one's list of builtins is found once, while none is replaced (before any launch), and
    each launch replaces the same members with the same wrappers as before. False (nothing changed) where this
    Triton's interpreter lacks the function."""
    return _replace_in_interpreter("_patch_builtin", _patch_builtin_from_lists_found_once)


def _patch_builtin_from_lists_found_once(original):
    import triton.language as tl
    from triton.runtime import interpreter

    builtins = {}  # id(pkg) -> (pkg, [(name, member)]): the originals, listed before any launch replaced them
    for pkg in (tl, tl.core, tl.tensor, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base):
        builtins[id(pkg)] = (pkg, [(name, member) for name, member in inspect.getmembers(pkg)
                                   if tl.core.is_builtin(member)])

    def patch_builtin(pkg, builder, scope) -> None:
        listed = builtins.get(id(pkg))
        if listed is None or listed[0] is not pkg:
            original(pkg, builder, scope)
            return
        for name, member in listed[1]:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    return patch_builtin


def scalar_index_from_one_element_arrays() -> bool:
    """A kernel's scalar argument is a one-element array in the interpreter; Triton 3.6's turns it into a loop bound
    or index with `int(array)`, which numpy 2.4 refuses for an array of one dimension ("only 0-dimensional arrays
    can be converted to Python scalars": every kernel with `range(0, K, ...)` fails). Newer Triton squeezes the
    array first; this gives every version that behaviour. False (nothing changed) where the interpreter lacks the
    function."""
    return _replace_in_interpreter("_patch_lang_tensor", _patch_lang_tensor_squeezing_index)


def _patch_lang_tensor_squeezing_index(original):
    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch_lang_tensor


def fp32_float_arguments(original):
    """The interpreter's argument conversion (`_implicit_cvt`) passing a Python float as an fp32 scalar tensor, as
    compiled Triton types a float argument. Triton 3.8's interpreter passes the float itself, and liger-kernel's
    RMSNorm and SwiGLU kernels then fail at `eps.to(tl.float32)` ("'float' object has no attribute 'to'"). Installed
    by tests/test_fused_ops.py for its own tests only (other kernels' float arguments keep the interpreter's
    behaviour)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    return implicit_cvt


def interpretable_liger_rms_norm(monkeypatch) -> None:
    """liger-kernel's RMSNorm kernels under the interpreter: their `rsqrt` is libdevice's, a stub the compiler
    resolves and the interpreter cannot run (it returns None); here it is triton.language's rsqrt, which the
    interpreter computes in numpy (1 / sqrt in fp32, as torch.rsqrt on the CPU). On a GPU both are the hardware's
    approximate reciprocal square root. Float arguments as in compiled Triton (fp32_float_arguments). Through
    `monkeypatch`, so only the calling test sees either change."""
    import liger_kernel.ops.rms_norm as liger_rms_norm
    import triton.language as tl
    from triton.runtime import interpreter

    def rsqrt(x):  # looked up at the call: the interpreter replaces tl.math's members during a launch
        return tl.math.rsqrt(x)

    monkeypatch.setattr(liger_rms_norm, "rsqrt", rsqrt)
    monkeypatch.setattr(interpreter, "_implicit_cvt", fp32_float_arguments(interpreter._implicit_cvt))


def bf16_arithmetic_as_on_a_gpu(monkeypatch) -> None:
    """bf16 in the interpreter as a GPU computes it. Triton 3.8's interpreter stores bf16 as uint16 bit patterns
    and then (1) does arithmetic and math on those integers (bf16 * bf16 is garbage: liger's SwiGLU forward gave
    values of 1e34 for inputs of order 1) and (2) converts fp32 to bf16 by truncation where the compiled `.to()`
    rounds to nearest even (a 1-ulp bias in every cast). Here a bf16 operand is widened to fp32 (exact), the
    operation runs in fp32 and a bf16 result is rounded to nearest even by torch: the GPU's bf16 add and multiply
    up to double rounding (a product of two bf16 values is exact in fp32, so only a sum can differ, in its last
    bit). Through `monkeypatch`, so only the calling test sees it."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def to_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = torch.from_numpy(np.array(handle.data, copy=True).view(np.int16))
        return TensorHandle(bits.view(torch.bfloat16).float().numpy(), tl.float32)

    def to_bf16(data):
        rounded = torch.from_numpy(np.array(data, dtype=np.float32, copy=True)).to(torch.bfloat16)
        return TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    original_binary, original_unary, original_cast = (InterpreterBuilder.binary_op, InterpreterBuilder.unary_op,
                                                      InterpreterBuilder.cast_impl)

    def binary_op(self, lhs, rhs, op):
        if tl.bfloat16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return original_binary(self, lhs, rhs, op)
        out = original_binary(self, to_fp32(lhs), to_fp32(rhs), op)
        return to_bf16(out.data) if out.data.dtype == np.float32 else out

    def unary_op(self, arg, op):
        if arg.dtype.scalar != tl.bfloat16:
            return original_unary(self, arg, op)
        return to_bf16(original_unary(self, to_fp32(arg), op).data)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src.data)
        return original_cast(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "binary_op", binary_op)
    monkeypatch.setattr(InterpreterBuilder, "unary_op", unary_op)
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast_impl)
