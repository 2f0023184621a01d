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
