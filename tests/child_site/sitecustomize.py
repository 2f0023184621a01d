"""Run at the start of every test process and of the processes tests start (tests/conftest.py puts this folder on
PYTHONPATH): torchmetrics' optional integrations with torchvision and transformers read as not installed.

Lightning imports all of torchmetrics, which imports torchvision's models and transformers when they are
installed (the test extra installs both): ~2 s of every Lightning import, for metrics (BERTScore, CLIP, ARNIQA)
that mhar_lit never uses. Only torchmetrics' and Lightning's availability checks (lightning_utilities'
RequirementCache) are changed: `import torchvision` and `import transformers` work as before, so the tests that
use transformers themselves (export, convert, lm_eval) are unchanged."""

import importlib.abc
import importlib.util
import sys

HIDDEN = frozenset({"torchvision", "transformers"})
CHECKS = "lightning_utilities.core.imports"


def hide_from_requirement_checks(imports_module) -> None:
    """RequirementCache(\"torchvision...\") and RequirementCache(\"transformers...\") evaluate to False."""
    cache = imports_module.RequirementCache
    if getattr(cache, "_hides", None):
        return
    check = cache._check_requirement

    def check_hiding(self) -> None:
        check(self)
        if imports_module.Requirement(self.requirement).name in HIDDEN:
            self.available = False
            self.message = f"{self.requirement!r} hidden from the tests' processes (tests/child_site/sitecustomize.py)"

    cache._check_requirement = check_hiding
    cache._hides = HIDDEN


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
