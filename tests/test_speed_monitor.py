"""SpeedMonitor in a real (CPU) Lightning fit: one logged value per window, validation time left out."""

import time

import lightning as L
import pytest
import torch
from capture_logger import CaptureLogger

from mhar_lit.lit.callbacks import SpeedMonitor

VAL_SLEEP_S = 0.5


class _Tiny(L.LightningModule):
    """Token batches [B, T+1] as the callback expects; optionally a slow validation pass."""

    def __init__(self, slow_validation=True):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.slow_validation = slow_validation

    def training_step(self, batch, batch_idx):
        loss = self.lin(batch[:, :-1].float()).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.slow_validation:
            time.sleep(VAL_SLEEP_S)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _SlowSaveAtValidationEnd(L.Callback):
    """Stands in for ModelCheckpoint, which saves at validation end and which Lightning runs last."""

    def on_validation_end(self, trainer, pl_module):
        time.sleep(VAL_SLEEP_S)


@pytest.mark.parametrize("slow", ["validation", "save_at_validation_end"])
def test_one_value_per_window_and_validation_time_excluded(slow):
    data = torch.randint(0, 100, (128, 9))
    logger = CaptureLogger()
    trainer = L.Trainer(accelerator="cpu", max_steps=12, val_check_interval=6, limit_val_batches=1,
                        num_sanity_val_steps=0, log_every_n_steps=2, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SpeedMonitor(every_n_steps=4, skip_steps=1)]
                        + ([_SlowSaveAtValidationEnd()] if slow == "save_at_validation_end" else []))
    loader = lambda x: torch.utils.data.DataLoader(x, batch_size=2)  # noqa: E731
    trainer.fit(_Tiny(slow_validation=slow == "validation"), train_dataloaders=loader(data),
                val_dataloaders=loader(data[:2]))
    speed = [(step, v) for step, k, v in logger.rows if k == "train/tokens_per_s"]
    # once per window (after optimizer steps 4, 8, 12), never re-emitted, at the step where Lightning logged the
    # loss of the window's last batch (log_every_n_steps=2: steps 1, 3, .., 11), so the charts line up
    assert [step for step, _ in speed] == [3, 7, 11], speed
    loss_steps = {step for step, k, _ in logger.rows if k == "train/loss"}
    assert {step for step, _ in speed} <= loss_steps, (speed, sorted(loss_steps))
    # the window of steps 5-8 holds the validation after step 6: with its (or the save's) 0.5 s counted,
    # 4 steps x 16 tokens could not pass 128 tokens/s; CPU steps of this model take milliseconds, so a correct window is far above
    tokens_per_window = 4 * 2 * 8
    assert min(v for _, v in speed) > 4 * tokens_per_window / VAL_SLEEP_S, speed
