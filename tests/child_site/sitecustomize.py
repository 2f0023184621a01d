"""Run at the start of every test process and of the processes tests start (tests/conftest.py puts this folder on
PYTHONPATH): torchmetrics' optional integrations with torchvision, transformers and scipy read as not installed.

Lightning imports all of torchmetrics, which imports torchvision's models, transformers and scipy.signal when they
are installed (the test extra installs all three): ~2 s of a ~6 s Lightning import on an idle core, for metrics
(BERTScore, CLIP, ARNIQA, SciPy's permutation solver) that mhar_lit never uses. Only the availability checks of
lightning_utilities (RequirementCache, package_available), which torchmetrics, Lightning and litdata read, are
changed: `import transformers` and the others work as before, so the tests that use transformers themselves
(export, convert, lm_eval) are unchanged."""

import importlib.abc
import importlib.util
import sys

HIDDEN = frozenset({"torchvision", "transformers", "scipy"})
CHECKS = "lightning_utilities.core.imports"


def hide_from_requirement_checks(imports_module) -> None:
    """RequirementCache("NAME...") and package_available("NAME") are False for the HIDDEN names. A
    lightning_utilities without the private method patched here is left as it is: the tests then only run slower."""
    cache = imports_module.RequirementCache
    check = getattr(cache, "_check_requirement", None)
    if getattr(cache, "_hides", None) or check is None or not hasattr(imports_module, "Requirement"):
        return

    def check_hiding(self) -> None:
        check(self)
        if imports_module.Requirement(self.requirement).name in HIDDEN:
            self.available = False
            self.message = f"{self.requirement!r} hidden from the tests' processes (tests/child_site/sitecustomize.py)"

    cache._check_requirement = check_hiding
    cache._hides = HIDDEN
    available = imports_module.package_available
    imports_module.package_available = lambda name: name not in HIDDEN and available(name)


class _PatchChecksOnImport(importlib.abc.MetaPathFinder):
    """Patches lightning_utilities' checks once that module is loaded (nothing is imported before it is needed)."""

    def find_spec(self, name, path, target=None):
        if name != CHECKS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            exec_module(module)
            hide_from_requirement_checks(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if CHECKS in sys.modules:
    hide_from_requirement_checks(sys.modules[CHECKS])
else:
    sys.meta_path.insert(0, _PatchChecksOnImport())
