"""Triton's interpreter without its repeated set-up inside a launch (tests only; the kernels' code paths unchanged).

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


def patch_lang_once_per_launch() -> bool:
    """Install the shortcut; False (nothing changed) where this Triton's interpreter lacks the hook it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "once_per_launch", False):
        return original is not None
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

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang
    return True
