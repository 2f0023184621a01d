"""Kill hooks for benchmarks/fault_injection.py: a `fit` process SIGKILLs itself at a planned point.

Python imports `sitecustomize` at start-up from sys.path; fault_injection.py puts this folder first on the
PYTHONPATH of the sweeps it runs, with MHAR_FAULT_PLAN naming a JSON file:

    {"kills": [{"run": "mhar seed=1", "where": "after_save", "step": 6}, ...], "done_dir": "..."}

A fit whose run name (--trainer.logger.init_args.run_name) starts with an entry's `run` kills itself, once per
entry (a marker file in done_dir, written before the kill, keeps its resumed successor alive):
- `after_save`: right after last.ckpt holds global step `step` (file, link and sidecar on disk), before the
  process does anything else (log the step, validate, finish the run);
- `in_save`: while that step's checkpoint bytes are being written (its temp file half written).

The kill is SIGKILL to itself: nothing runs after it (no finally, no atexit, no logger flush), as with an OOM
kill or a lost node. Nothing is patched unless MHAR_FAULT_PLAN is set.
"""

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys

PLAN = os.environ.get("MHAR_FAULT_PLAN")
TARGETS = ("mhar_lit.lit.checkpoint_io", "mhar_lit.lit.checkpoint_callbacks")


def _run_name() -> str:
    argv = sys.argv
    flag = "--trainer.logger.init_args.run_name"
    return next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag), "")


def _due(where: str, step: int):
    """The plan entry to carry out here (and mark done), or None."""
    plan = json.load(open(PLAN))
    name = _run_name()
    for index, kill in enumerate(plan["kills"]):
        marker = os.path.join(plan["done_dir"], f"kill-{index}")
        if kill["where"] == where and kill["step"] == step and name.startswith(kill["run"]) and not os.path.exists(
                marker):
            with open(marker, "w") as fh:
                json.dump({**kill, "pid": os.getpid()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            return kill
    return None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(module) -> None:
    if module.__name__.endswith("checkpoint_io"):
        _patch_io(module)
    else:
        _patch_last_link(module)


def _patch_io(module) -> None:
    cls = module.AtomicCheckpointIO
    save = cls.save_checkpoint

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        step = int(checkpoint.get("global_step", -1))
        if _due("in_save", step):
            real_write, written = module._HashingWriter.write, [0]

            def write(sink, data):
                count = real_write(sink, data)
                written[0] += count
                if written[0] > 16 << 10:  # well inside the file: its temp file is half written
                    sink.flush()
                    _die()
                return count

            module._HashingWriter.write = write
        save(self, checkpoint, path, storage_options)
        if os.path.basename(str(path)).startswith("last") and _due("after_save", step):
            _die()

    cls.save_checkpoint = save_checkpoint


def _patch_last_link(module) -> None:
    cls = module.OneCopyCheckpoint
    save_last = cls._save_last_checkpoint

    def _save_last_checkpoint(self, trainer, monitor_candidates):
        save_last(self, trainer, monitor_candidates)
        if _due("after_save", trainer.global_step):
            _die()

    cls._save_last_checkpoint = _save_last_checkpoint


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if PLAN:
    sys.meta_path.insert(0, _PatchAfterImport())
