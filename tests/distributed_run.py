"""Helper script for tests/test_distributed.py (run as a subprocess; Lightning's DDP launcher re-executes it).

    python tests/distributed_run.py OUT_DIR STRATEGY DEVICES RESIDUAL [RESIDUAL ...]

Trains LanguageModel for a few steps on CPU with a deterministic batch schedule: the global batch of step
k is the same 4 sequences whatever the number of processes (rank r of W takes rows r::W), so a W-process
run must reproduce the single-process losses. One fit per residual, one after the other in the same
processes (the later fits reuse the first one's process group: starting processes cost more than the fits).
Writes OUT_DIR/RESIDUAL/losses_rank{r}.json with each step's local loss and the number of sequences it covered.
"""

import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from mhar_lit.lit.module import LanguageModel
from mhar_lit.residual import DeltaAttnRes, FullAttnRes, StandardResidual

GLOBAL_BATCH, SEQ, STEPS, VOCAB = 4, 17, 4, 256


class GlobalBatches(Dataset):
    """Item k = this rank's share of global batch k (fixed random tokens)."""

    def __init__(self, rank: int, world: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.batches = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=gen)
        self.rank, self.world = rank, world

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.batches[k, self.rank :: self.world]


class Data(L.LightningDataModule):
    def train_dataloader(self):
        trainer = self.trainer
        dataset = GlobalBatches(trainer.global_rank, trainer.world_size)
        return DataLoader(dataset, batch_size=None, shuffle=False)


class Record(L.Callback):
    def __init__(self, out: str) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({"step": trainer.global_step, "loss": float(outputs["loss"]), "rows": batch.shape[0]})

    def on_train_end(self, trainer, pl_module):
        with open(os.path.join(self.out, f"losses_rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(self.rows, fh)


RESIDUALS = {"mhar": lambda: FullAttnRes(heads=4, random_query_init=True), "standard": StandardResidual,
             "delta": lambda: DeltaAttnRes(heads=4, layers_per_block=1)}


def fit(out: str, strategy: str, devices: int, residual_name: str) -> None:
    os.makedirs(out, exist_ok=True)
    L.seed_everything(7)
    residual = RESIDUALS[residual_name]()
    model = LanguageModel(size="tiny", residual=residual, lr=3e-3, warmup_steps=1, decay_steps=STEPS, z_loss=1e-4)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record(out)], use_distributed_sampler=False)
    trainer.fit(model, Data())


def main() -> None:
    out, strategy, devices, residuals = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    unknown = sorted(set(residuals) - set(RESIDUALS))
    if not residuals or unknown:
        raise SystemExit(f"usage: distributed_run.py OUT_DIR STRATEGY DEVICES RESIDUAL...; residuals: "
                         f"{', '.join(RESIDUALS)}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    for residual_name in residuals:
        fit(os.path.join(out, residual_name), strategy, devices, residual_name)


if __name__ == "__main__":
    main()
