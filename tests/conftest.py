"""Test-suite set-up shared by every test module.

Triton kernels run on CPU tensors through Triton's interpreter in the tests. Triton reads
TRITON_INTERPRET when @triton.jit decorates a function, so it must be set before any test module
imports mhar_lit.kernels (pytest may collect top-level test files before tests/kernels/). The interpreter runs
without its repeated set-up inside a launch and with two of its look-ups done once (tests/triton_interpreter.py).

`make test` runs the suite on every core through pytest-xdist: each worker then gets its share of the cores
for torch's threads (set before torch is imported, and inherited by the processes tests start), so that the
workers do not oversubscribe the machine.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0 keeps compiled kernels (the GPU matrix test)
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))

# tests/child_site/sitecustomize.py: torchmetrics' optional torchvision, transformers and scipy integrations, ~2 s of
# each Lightning import, off in this process and (through PYTHONPATH) in the processes tests start
_CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")
if _CHILD_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_CHILD_SITE, os.environ.get("PYTHONPATH", "")) if p)

import contextlib  # noqa: E402
import functools  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import sqlite3  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

if _CHILD_SITE not in sys.path:
    sys.path.insert(0, _CHILD_SITE)
import sitecustomize  # noqa: E402, F401  (the same set-up in this process)
from seeds import draw_seed  # noqa: E402
from start_order import longest_first_chunks  # noqa: E402


def _controls_xdist_workers(config) -> bool:
    """The controlling process of an xdist run: it starts the workers and collects their reports, and runs,
    collects and imports no test itself."""
    distributed = config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))
    return distributed and not config.getoption("collectonly") and not hasattr(config, "workerinput")


def pytest_configure(config):
    """Lightning and the Triton interpreter, set up in each process that runs tests (each xdist worker, or the one
    process without xdist), before any test module is imported. The controlling process of an xdist run skips them:
    their ~10 s of imports there would delay the start of every worker."""
    if _controls_xdist_workers(config):
        return
    # Lightning attaches its log handler to the sys.stderr of the moment it is first imported: imported inside a
    # test, that is the test's capsys stream, closed after it, and every later log line of the process fails to print
    import lightning  # noqa: F401

    if os.environ["TRITON_INTERPRET"] == "1":
        from triton_interpreter import (builtin_lists_found_once, numpy_dtypes_from_one_table,
                                        patch_lang_once_per_launch, scalar_index_from_one_element_arrays)

        patch_lang_once_per_launch()
        numpy_dtypes_from_one_table()
        builtin_lists_found_once()
        scalar_index_from_one_element_arrays()


# ------------------------------------------------------------------------------------------ the order on xdist workers
@pytest.hookimpl(trylast=True)  # after `-m` deselected what this run leaves out
def pytest_collection_modifyitems(config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        items[:] = [item for chunk in longest_first_chunks(items, workers) for item in chunk]


@pytest.fixture(autouse=True)
def _seeded_global_rngs():
    """Every test starts from global RNGs seeded by its own fixed seed (tests/seeds.py), so a test's draws do not
    depend on which tests ran before it; MHAR_RANDOM_SEEDS=1 draws fresh seeds instead."""
    import numpy as np
    import torch

    seed = draw_seed()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    yield


# ---------------------------------------------------------------------------------------------- shared across workers
def _run_root(tmp_path_factory) -> Path:
    """A folder of this test run shared by all xdist workers (each worker's own base folder otherwise)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _built_once(tmp_path_factory, name: str):
    """(folder, done): `done` is False for the one process of the run that must build `folder`; the others wait
    for it (a file lock) and find it built."""
    from filelock import FileLock

    root = _run_root(tmp_path_factory)
    folder, marker = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        done = marker.is_file()
        folder.mkdir(exist_ok=True)
        yield folder, done
        marker.touch()


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """built_once(name): _built_once for a test module's own shared artefact (a context manager giving (folder,
    done); build into folder when not done)."""
    return functools.partial(_built_once, tmp_path_factory)


@pytest.fixture(scope="session")
def trained_demo_checkpoint(tmp_path_factory) -> Path:
    """last.ckpt of a tiny FullAttnRes (H = 4) model trained for 4 steps by the real `fit` on configs/demo.yaml
    (test_cli._tiny_args: its corpus, byte tokens), built once per test run and shared by every worker. Read it;
    write nothing beside it."""
    with _built_once(tmp_path_factory, "trained_demo") as (folder, done):
        record = folder / "checkpoint_path.txt"
        if not done:
            from test_cli import _tiny_args

            from mhar_lit.cli import build_cli

            cli = build_cli(["fit", *_tiny_args(folder, "--trainer.max_steps", "4", "--trainer.default_root_dir",
                                                str(folder / "runs"))])
            record.write_text(cli.trainer.checkpoint_callback.last_model_path)
    return Path(record.read_text())


@pytest.fixture(scope="session", autouse=True)
def _new_mlflow_stores_from_a_template(tmp_path_factory):
    """A new sqlite MLflow store opened in a test process starts as a copy of one store that MLflow created and
    migrated once per test run, instead of running MLflow's schema migrations again (5-10 s each on 2 cores).
    The copy is the same file MLflow would have written, with its default experiment's artifact location set as
    MLflow sets it; stores that already exist, and stores created by the processes tests start, are untouched."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient

    with _built_once(tmp_path_factory, "mlflow_template") as (folder, done):
        template = folder / "mlflow.db"
        if not done:
            MlflowClient(f"sqlite:///{template}").search_experiments(max_results=1)
    original_init = SqlAlchemyStore.__init__

    def init_from_template(self, db_uri, default_artifact_root, *args, **kwargs):
        path = Path(db_uri[len("sqlite:///"):].split("?")[0]) if db_uri.startswith("sqlite:///") else None
        copied = path is not None and not path.exists() and path.parent.is_dir()
        if copied:
            shutil.copyfile(template, path)
        original_init(self, db_uri, default_artifact_root, *args, **kwargs)
        if copied:
            with contextlib.closing(sqlite3.connect(path)) as db, db:
                db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                           (self._get_artifact_location(0),))

    SqlAlchemyStore.__init__ = init_from_template
    yield
    SqlAlchemyStore.__init__ = original_init
