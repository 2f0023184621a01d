"""What a SIGKILL leaves, window by window: each test builds exactly the files a kill at that point leaves (a
kill is a process that stops between two lines; the files are the whole story) and resumes from them.

benchmarks/fault_injection.py kills real sweeps in these windows; these tests pin each window down."""

import logging
import math
import os

import pytest
import torch

from mhar_lit.cli import build_cli
from tiny_run import tiny_fit_args


def _fit(args, ckpt_path=None):
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return cli


def _client(tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


def _history(client, run_id, key):
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_a_step_checkpoint_at_a_validating_step_is_written_after_that_validation(tmp_path, monkeypatch):
    """every_n_train_steps 3 with a validation every 3 steps: the step-3 file holds the step-3 validation, so a
    kill right after it loses nothing, and the resume's validation history (the tail-mean's input) is the
    uninterrupted one exactly. (Saved before the validation, Lightning's resume counts it as done: lost.)"""
    monkeypatch.chdir(tmp_path)
    args = tiny_fit_args(tmp_path, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
                         "--checkpoint.save_top_k", "-1")
    full = _fit(args)
    folder = full.trainer.checkpoint_callback.dirpath
    step3 = os.path.join(folder, "epoch=0-step=3.ckpt")
    saved = torch.load(step3, weights_only=False)
    assert saved["global_step"] == 3 and len(saved["mhar_lit"]["val_history"]) == 1
    assert saved["mhar_lit"]["val_history"][0] == pytest.approx(full.model.val_history[0], rel=1e-9)

    resumed = _fit(args, ckpt_path=step3)  # what a kill right after the step-3 save leaves
    assert resumed.model.val_history == pytest.approx(full.model.val_history, rel=1e-6)
    assert len(resumed.model.val_history) == 2  # not re-run at step 3, not dropped


def test_a_fit_killed_after_its_final_checkpoint_resumes_into_the_same_chain(tmp_path, monkeypatch):
    """Killed after the last save: the resumed fit ends at once (max_steps reached), yet its run is tagged as the
    continuation of the killed one, so `compare` shows one finished row with the killed run's final and tail."""
    from mhar_lit.sweep import _run_row, chain_runs

    monkeypatch.chdir(tmp_path)
    args = tiny_fit_args(tmp_path, "--trainer.max_steps", "6")
    first = _fit(args)
    client = _client(tmp_path)
    first_id = first.trainer.logger.run_id
    client.set_terminated(first_id, "KILLED")  # what the reaper marks a run whose process died
    last = first.trainer.checkpoint_callback.last_model_path
    again = _fit(args, ckpt_path=last)
    run = client.get_run(again.trainer.logger.run_id)
    assert again.trainer.global_step == 6 and run.data.tags["resumed_from_run"] == first_id
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    rows = [_run_row(client, uri, client.get_run(r)) for r in (first_id, again.trainer.logger.run_id)]
    (chain,) = chain_runs(rows)
    final_val = _history(client, first_id, "val/loss")[max(_history(client, first_id, "val/loss"))]
    assert chain["status"] == "FINISHED" and chain["final"] == pytest.approx(final_val)
    assert not math.isnan(chain["tail_mean"])


def test_the_step_a_save_precedes_is_logged_by_the_resumed_run(tmp_path, monkeypatch):
    """Lightning saves a step checkpoint before it logs that step's metrics: the checkpoint records them and the
    resumed run logs them, so a kill between the save and the log costs no train/loss point."""
    from mhar_lit.lit.checkpoint_callbacks import UNLOGGED_STEP_METRICS

    monkeypatch.chdir(tmp_path)
    args = tiny_fit_args(tmp_path, "--trainer.max_steps", "4", "--checkpoint.every_n_train_steps", "2",
                         "--checkpoint.save_top_k", "-1")
    full = _fit(args)
    client = _client(tmp_path)
    logged = _history(client, full.trainer.logger.run_id, "train/loss")
    assert sorted(logged) == [0, 1, 2, 3]
    step2 = os.path.join(full.trainer.checkpoint_callback.dirpath, "epoch=0-step=2.ckpt")
    pending = torch.load(step2, weights_only=False)[UNLOGGED_STEP_METRICS]
    assert pending["step"] == 1 and pending["metrics"]["train/loss"] == pytest.approx(logged[1], rel=1e-6)

    resumed = _fit(args, ckpt_path=step2)  # the parent died before logging step 1
    child = _history(client, resumed.trainer.logger.run_id, "train/loss")
    assert sorted(child) == [1, 2, 3]
    for step, value in child.items():
        assert value == pytest.approx(logged[step], rel=1e-5), step


def test_a_restarted_run_removes_the_temp_files_of_killed_saves_in_sibling_run_folders(tmp_path, monkeypatch):
    """A run restarted instead of resumed writes to a new folder: the temp file that a save killed in the old
    folder left is removed at the new run's start, unless a live save still holds its lock."""
    from mhar_lit.data.integrity import hold_new_lock

    monkeypatch.chdir(tmp_path)
    old = tmp_path / "runs" / "old" / "checkpoints"
    old.mkdir(parents=True)
    dead = old / ".last.ckpt.tmp-123-456"
    dead.write_bytes(b"half a checkpoint")
    live = hold_new_lock(old / ".last.ckpt.tmp-789-1")
    try:
        _fit(tiny_fit_args(tmp_path, "--trainer.max_steps", "1", "--run_name", "new"))
        assert not dead.exists() and (old / ".last.ckpt.tmp-789-1").exists()
    finally:
        live.close()


def test_trainer_plugins_keep_the_atomic_verified_checkpoint_io(tmp_path, monkeypatch, caplog):
    from mhar_lit.lit.checkpoint_io import AtomicCheckpointIO

    monkeypatch.chdir(tmp_path)
    cli = build_cli(tiny_fit_args(tmp_path, "--trainer.plugins",
                                  "lightning.fabric.plugins.environments.LightningEnvironment"), run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    with caplog.at_level(logging.WARNING):
        cli = build_cli(tiny_fit_args(tmp_path, "--trainer.plugins", "lightning.fabric.plugins.TorchCheckpointIO"),
                        run=False)
    assert type(cli.trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"
    assert "without mhar_lit's atomic writes and sha256 sidecars" in caplog.text


def test_a_cache_folder_without_its_checksums_is_refused(tmp_path):
    """Every cache folder `prepare` writes carries checksums.json: one without it cannot be checked, and a
    corrupted chunk would train silently."""
    from mhar_lit.data.integrity import MANIFEST_NAME, CorruptFileError
    from mhar_lit.data.prepare import prepare
    from mhar_lit.data.tokenizer import ByteTokenizer
    from tiny_run import tiny_corpus

    corpus = str(tiny_corpus(tmp_path))
    prepared = prepare(corpus, ByteTokenizer(), cache_dir=tmp_path / "cache", val_fraction=0.2)
    final = os.path.dirname(prepared.train_dir)
    os.remove(os.path.join(final, MANIFEST_NAME))
    chunk = next(p for p in os.listdir(prepared.train_dir) if p.endswith(".bin"))
    with open(os.path.join(prepared.train_dir, chunk), "r+b") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(CorruptFileError, match=f"have no {MANIFEST_NAME}.*Delete {final}"):
        prepare(corpus, ByteTokenizer(), cache_dir=tmp_path / "cache", val_fraction=0.2)


def test_a_named_run_resumes_from_its_newest_verified_checkpoint(tmp_path, monkeypatch):
    """`--run_name NAME --ckpt_path last`: the stable folder's newest checkpoint whose sidecar verifies; none (or
    no name) is an error, and a fresh fit under a used name is refused."""
    from mhar_lit.checkpoint import sidecar_path
    from mhar_lit.errors import UserError

    monkeypatch.chdir(tmp_path)

    def named(steps, name="r1"):
        return tiny_fit_args(tmp_path, "--trainer.max_steps", str(steps), "--run_name", name)

    first = _fit(named(3))
    folder = tmp_path / "runs" / "r1" / "checkpoints"
    assert first.trainer.checkpoint_callback.dirpath == str(folder) and (folder / "last.ckpt").is_file()
    assert _client(tmp_path).get_run(first.trainer.logger.run_id).info.run_name == "r1"
    with pytest.raises(UserError, match="already holds checkpoints of a run of that name"):
        build_cli(named(5), run=False)
    with pytest.raises(UserError, match="--ckpt_path last needs --run_name"):
        build_cli(["fit", *tiny_fit_args(tmp_path, "--trainer.max_steps", "5"), "--ckpt_path", "last"])
    with pytest.raises(UserError, match="no verified checkpoint of run 'r2'"):
        build_cli(["fit", *named(5, "r2"), "--ckpt_path", "last"])

    resumed = build_cli(["fit", *named(5), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 5 and resumed.trainer.ckpt_path == str(folder / "last.ckpt")
    sidecar_path(folder / "last.ckpt").unlink()  # an unverifiable last.ckpt is skipped for the newest verified
    fallback = build_cli(["fit", *named(6), "--ckpt_path", "last"])
    assert fallback.trainer.ckpt_path != str(folder / "last.ckpt") and fallback.trainer.global_step == 6
