"""AtomicCheckpointIO: a killed save keeps the previous checkpoint, damaged files are refused, old files load."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from subprocess_env import python_path

from mhar_lit.lit.checkpoint_io import (
    AtomicCheckpointIO,
    CorruptCheckpointError,
    sidecar_path,
)

REPO = Path(__file__).resolve().parents[1]


class TinyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(128, 128)  # 64 KiB of weights: most of the file

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=8)


def make_trainer(root, max_steps, **kw):
    return L.Trainer(plugins=[AtomicCheckpointIO()], max_steps=max_steps, accelerator="cpu", devices=1,
                     default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True)], **kw)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def flip_16_bytes(path):
    data = bytearray(Path(path).read_bytes())
    middle = len(data) // 2  # inside the weights
    data[middle : middle + 16] = bytes(b ^ 0x5A for b in data[middle : middle + 16])
    Path(path).write_bytes(bytes(data))


def test_fit_saves_with_sidecars_and_resumes(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.fit(TinyModel())
    last = tmp_path / "ckpt" / "last.ckpt"
    assert sidecar_path(last).read_text() == f"{sha256(last)}  last.ckpt\n"  # sha256sum -c format
    assert not list((tmp_path / "ckpt").glob(".*"))  # no temp files left
    manual = tmp_path / "manual" / "by-hand.ckpt"
    trainer.save_checkpoint(manual)
    assert sidecar_path(manual).read_text().split()[0] == sha256(manual)

    resumed = make_trainer(tmp_path, max_steps=5)
    resumed.fit(TinyModel(), ckpt_path=last)
    assert resumed.global_step == 5
    assert torch.load(last, weights_only=False)["global_step"] == 5


def test_flipped_bytes_are_refused_naming_the_file(tmp_path):
    make_trainer(tmp_path, max_steps=2).fit(TinyModel())
    last = tmp_path / "ckpt" / "last.ckpt"
    flip_16_bytes(last)
    with pytest.raises(CorruptCheckpointError, match=rf"{last} does not match the sha256"):
        make_trainer(tmp_path, max_steps=4).fit(TinyModel(), ckpt_path=last)


def test_a_checkpoint_without_a_sidecar_is_refused_until_its_checksum_is_recorded(tmp_path):
    """Unchecked bytes could resume a corrupted run (flipped bytes, no sidecar: train/loss 0.0): refused, with the
    command that records the checksum of a file the user trusts; once recorded, the file loads."""
    from mhar_lit.checkpoint import UnverifiedCheckpointError, record_checksum

    make_trainer(tmp_path, max_steps=2).fit(TinyModel())
    last = tmp_path / "ckpt" / "last.ckpt"
    sidecar_path(last).unlink()
    with pytest.raises(UnverifiedCheckpointError, match=rf"no checksum file last.ckpt.sha256.*sha256sum {last}"):
        make_trainer(tmp_path, max_steps=4).fit(TinyModel(), ckpt_path=last)
    record_checksum(last)
    assert sidecar_path(last).read_text() == f"{sha256(last)}  last.ckpt\n"  # what sha256sum writes
    assert AtomicCheckpointIO().load_checkpoint(last, weights_only=False)["global_step"] == 2


def test_removing_a_checkpoint_removes_its_sidecar(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"x": torch.ones(3)}, path)
    io.remove_checkpoint(path)
    assert list(tmp_path.iterdir()) == []


# The child saves a large tensor over an existing last.ckpt and is SIGKILLed while torch.save is writing:
# once half the bytes are out, the writer reports and waits for the kill.
KILLED_SAVE = """
import sys, time, torch
from mhar_lit.lit import checkpoint_io
dest = sys.argv[1]
checkpoint_io.AtomicCheckpointIO().save_checkpoint({"step": 1, "w": torch.ones(16)}, dest)
written, real_write = [0], checkpoint_io._HashingWriter.write
def slow_write(self, data):
    n = real_write(self, data)
    written[0] += n
    if written[0] > 32 << 20:
        print("midway", flush=True)
        time.sleep(600)
    return n
checkpoint_io._HashingWriter.write = slow_write
checkpoint_io.AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.ones(16 << 20)}, dest)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_intact(tmp_path):
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "tmpdir"
    folder.mkdir()
    elsewhere.mkdir()
    last = folder / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": python_path(), "TMPDIR": str(elsewhere)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(last)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout.readline().strip() == "midway"
        temp_files = list(folder.glob(".last.ckpt.tmp-*"))
        assert len(temp_files) == 1 and temp_files[0].stat().st_size > 32 << 20  # the new file is in the same folder
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert list(elsewhere.iterdir()) == []

    io = AtomicCheckpointIO()
    assert io.load_checkpoint(last)["step"] == 1  # verified against its sidecar, and whole
    assert not list(folder.glob(".*"))  # the dead save's temp file is cleaned at the next start
    io.save_checkpoint({"step": 3}, last)
    assert io.load_checkpoint(last)["step"] == 3


def test_a_live_save_temp_file_is_not_removed(tmp_path):
    from mhar_lit.data.integrity import hold_new_lock
    from mhar_lit.lit.checkpoint_io import remove_stale_temp_files

    live = hold_new_lock(tmp_path / ".last.ckpt.tmp-1-2")
    dead = tmp_path / ".last.ckpt.tmp-3-4"
    dead.write_bytes(b"partial")
    try:
        assert remove_stale_temp_files(tmp_path) == [dead]
        assert (tmp_path / ".last.ckpt.tmp-1-2").exists()
    finally:
        live.close()
