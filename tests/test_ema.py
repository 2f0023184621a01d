"""WeightEMA: fp32 EMA math, swap for validation, checkpoint save and resume."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mhar_lit.lit.ema import WeightEMA


def test_ema_math_matches_hand_computation():
    """shadow_t = d * shadow_{t-1} + (1 - d) * w_t, starting from the weights; kept in fp32."""
    layer = nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0]]))
    ema = WeightEMA(decay=0.9)
    ema.init_from(layer)
    for value in ([[3.0, 2.0]], [[-1.0, 0.0]]):
        with torch.no_grad():
            layer.weight.copy_(torch.tensor(value))
        ema.update(layer)
    # hand: [1, 2] -> 0.9*[1, 2] + 0.1*[3, 2] = [1.2, 2.0] -> 0.9*[1.2, 2.0] + 0.1*[-1, 0] = [0.98, 1.8]
    shadow = ema.shadow["weight"]
    assert shadow.dtype == torch.float32 and ema.num_updates == 2
    torch.testing.assert_close(shadow, torch.tensor([[0.98, 1.8]]), rtol=0, atol=1e-6)
    with ema.swapped(layer):
        torch.testing.assert_close(layer.weight.float(), torch.tensor([[0.98, 1.8]]).bfloat16().float())
    assert torch.equal(layer.weight.float(), torch.tensor([[-1.0, 0.0]]))


def test_start_step_tracks_weights_before_averaging():
    layer = nn.Linear(1, 1, bias=False)
    ema = WeightEMA(decay=0.9, start_step=1)
    ema.init_from(layer)
    with torch.no_grad():
        layer.weight.fill_(5.0)
    ema.update(layer, step=0)
    assert ema.shadow["weight"].item() == 5.0


class Tiny(L.LightningModule):
    """y = w x regression; records the weight it sees in validation and after every optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1, bias=False)
        self.seen_in_val: list[torch.Tensor] = []
        self.after_step: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after_step.append(self.layer.weight.detach().clone())

    def validation_step(self, batch, batch_idx):
        self.seen_in_val.append(self.layer.weight.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(-1, keepdim=True)), batch_size=4)


def _trainer(tmp_path, ema, steps):
    return L.Trainer(max_steps=steps, callbacks=[ema], accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                     val_check_interval=3, num_sanity_val_steps=0, limit_val_batches=1)


def test_callback_updates_after_steps_swaps_for_validation_and_checkpoints(tmp_path):
    """In fit: one update per optimizer step; validation sees the EMA; checkpoints carry and restore it."""
    torch.manual_seed(0)
    model, ema = Tiny(), WeightEMA(decay=0.5)
    start = model.layer.weight.detach().clone()
    trainer = _trainer(tmp_path, ema, steps=4)
    trainer.fit(model, _loader(), _loader())
    expected = start
    history = []
    for weight in model.after_step:
        expected = 0.5 * expected + 0.5 * weight
        history.append(expected)
    assert ema.num_updates == 4
    torch.testing.assert_close(ema.shadow["layer.weight"], expected)
    torch.testing.assert_close(model.seen_in_val[0], history[2])  # validation after step 3 saw the EMA
    assert torch.equal(model.layer.weight, model.after_step[-1])  # training weights restored afterwards

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    saved = next(v for k, v in state["callbacks"].items() if "WeightEMA" in k)
    torch.testing.assert_close(saved["shadow"]["layer.weight"], expected)
    assert torch.equal(state["state_dict"]["layer.weight"], model.after_step[-1])

    resumed_ema, resumed = WeightEMA(decay=0.5), Tiny()
    _trainer(tmp_path, resumed_ema, steps=5).fit(resumed, _loader(), _loader(), ckpt_path=path)
    expected = 0.5 * expected + 0.5 * resumed.after_step[-1]
    assert resumed_ema.num_updates == 5
    torch.testing.assert_close(resumed_ema.shadow["layer.weight"], expected)


def test_gradient_accumulation_updates_once_per_optimizer_step(tmp_path):
    torch.manual_seed(0)
    ema = WeightEMA(decay=0.9)
    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[ema], accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(Tiny(), _loader())
    assert ema.num_updates == 2


def test_bad_decay_is_rejected():
    with pytest.raises(ValueError, match="decay"):
        WeightEMA(decay=1.0)


def _sharded_worker(rank, world, init_file, ckpt_file):
    """One rank of a 2-process gloo run: save a per-rank shadow through rank 0, restore each rank's slice."""
    import types

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    FSDPStrategy = type("FSDPStrategy", (), {})  # noqa: N806  (recognised by name, as Lightning's)
    trainer = types.SimpleNamespace(global_rank=rank, world_size=world, strategy=FSDPStrategy())
    layer = nn.Linear(rank + 1, 1, bias=False)  # ranks hold differently shaped slices, as under FSDP
    ema = WeightEMA(decay=0.5)
    ema.setup(trainer, None, "fit")
    with torch.no_grad():
        layer.weight.fill_(float(rank + 1))
    ema.init_from(layer)
    state = ema.state_dict()  # a collective: every rank calls it, rank 0 receives all slices
    if rank == 0:
        torch.save(state, ckpt_file)
    dist.barrier()
    restored = WeightEMA(decay=0.5)
    restored.setup(trainer, None, "fit")
    restored.load_state_dict(torch.load(ckpt_file, weights_only=False))
    with torch.no_grad():
        layer.weight.zero_()
    restored._ensure_shadow(layer)
    assert torch.equal(restored.shadow["weight"], torch.full((1, rank + 1), float(rank + 1)))
    dist.destroy_process_group()


def test_sharded_shadow_is_gathered_to_rank0_and_restored_per_rank(tmp_path):
    """FSDP-style runs: every rank's EMA slice reaches the checkpoint and comes back to its own rank."""
    import torch.multiprocessing as mp

    # fork: the children reuse the imported torch/lightning instead of importing them again (seconds each).
    mp.start_processes(_sharded_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "ema.pt")), nprocs=2,
                       join=True, start_method="fork")
