"""LogCheckpointArtifact's final checkpoint in real CPU fits: last.ckpt holds the last step whatever the
validation interval, periodic checkpoints are unchanged, nothing is saved twice, save_last="link" is respected."""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mhar_lit.lit.callbacks import LogCheckpointArtifact
from mhar_lit.lit.module import LanguageModel


class _Saves(L.Callback):
    def __init__(self):
        self.steps = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.steps.append(trainer.global_step)


def _fit(tmp_path, max_steps, save_last=True):
    saves, ckpt = _Saves(), ModelCheckpoint(dirpath=tmp_path, save_last=save_last)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, val_check_interval=4, limit_val_batches=1,
                        logger=False, callbacks=[ckpt, saves, LogCheckpointArtifact()], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    data = torch.randint(0, 256, (40, 17))
    loader = lambda: torch.utils.data.DataLoader(data, batch_size=2)  # noqa: E731
    trainer.fit(LanguageModel(size="tiny", warmup_steps=1), loader(), loader())
    return ckpt, saves.steps


def _step(path):
    return torch.load(path, weights_only=False)["global_step"]


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_checkpoint_holds_the_final_step(tmp_path, save_last):
    ckpt, steps = _fit(tmp_path, max_steps=6, save_last=save_last)
    last = os.path.join(tmp_path, "last.ckpt")
    assert ckpt.last_model_path == last and _step(last) == 6 and not os.path.islink(last)
    assert _step(os.path.join(tmp_path, "epoch=0-step=4.ckpt")) == 4  # the periodic checkpoint is kept as it was
    assert steps.count(4) >= 1 and steps.count(6) == 1  # periodic save at 4, one final save at 6


def test_no_extra_save_when_the_last_step_was_saved(tmp_path):
    _, steps = _fit(tmp_path, max_steps=8)
    assert steps == [4, 4, 8, 8]  # ModelCheckpoint's top-k file and last.ckpt at each validation, nothing more


def test_a_folder_shared_with_an_earlier_run_keeps_its_last_checkpoint(tmp_path):
    """Two fits into one folder (no per-run folder: no MLflow logger or a fixed dirpath): the second run's final
    save goes to its own versioned last file, as ModelCheckpoint names it, not over the first run's."""
    _fit(tmp_path, max_steps=3)  # no validation: only the train-end save, last.ckpt at step 3
    assert _step(os.path.join(tmp_path, "last.ckpt")) == 3
    ckpt, _ = _fit(tmp_path, max_steps=6)
    assert _step(os.path.join(tmp_path, "last.ckpt")) == 3
    assert ckpt.last_model_path == os.path.join(tmp_path, "last-v1.ckpt") and _step(ckpt.last_model_path) == 6


class _StopAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True  # as max_time's Timer does


def test_the_validation_of_an_early_stop_stays_out_of_the_tail_mean(tmp_path):
    """Validation every 4 batches, a stop requested at step 6: Lightning validates at 4 and (extra) at 6; only the
    scheduled one enters val_history, which the tail-mean averages."""
    module = LanguageModel(size="tiny", warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=20, val_check_interval=4, check_val_every_n_epoch=None,
                        limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[_StopAt(6)])
    data = torch.randint(0, 256, (40, 17))
    loader = lambda: torch.utils.data.DataLoader(data, batch_size=2)  # noqa: E731
    validations = []
    module.on_validation_epoch_start = lambda: (validations.append(trainer.global_step),
                                                LanguageModel.on_validation_epoch_start(module))
    trainer.fit(module, loader(), loader())
    assert trainer.global_step == 6 and validations == [4, 6] and len(module.val_history) == 1
