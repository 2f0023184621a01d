"""precision "bf16-mixed" on the captured path: fp32 parameters, gradients and AdamW state, bf16 matmuls.

make_graphed_callables is replaced by a CPU stand-in that records what a real capture fixes: the autocast state
at capture (the real one refuses autocast's weight cache, so does the stand-in) is the one every replay runs,
forward and backward, whatever autocast surrounds the replay. Against it, a captured bf16-mixed fit must train
exactly as the eager bf16-mixed fit (Lightning's autocast, cache on: same casts, same values)."""

import lightning as L
import pytest
import torch
from graph_stand_in import captured_and_eager_models

from mhar_lit.lit import cuda_graph
from mhar_lit.lit.module import LanguageModel
from mhar_lit.residual import FullAttnRes


def _fit(module, batches, precision):
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, precision=precision,
                        enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=2)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


@pytest.fixture
def captured_and_eager(monkeypatch):
    captured, eager = captured_and_eager_models(monkeypatch)
    return captured, eager, [torch.randint(0, 256, (2, 9)) for _ in range(4)]


def test_captured_bf16_mixed_trains_as_eager_with_fp32_parameters_and_adam_state(captured_and_eager):
    """2 optimizer steps of 2 microbatches: parameters bitwise equal, and every parameter, gradient and AdamW
    moment fp32."""
    captured, eager, batches = captured_and_eager
    trainers = [_fit(module, batches, "bf16-mixed") for module in (captured, eager)]
    assert captured._graphed_loss.decision is True and captured._graphed_loss.graphed is not None
    for (name, p), (_, q) in zip(captured.named_parameters(), eager.named_parameters()):
        assert p.dtype == torch.float32, name
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    state = trainers[0].optimizers[0].state
    assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in state.values())


def test_captured_bf16_mixed_runs_its_matmuls_in_bf16(captured_and_eager):
    """The captured unit replays under bf16 autocast: the LM head returns bf16 logits there, and the parameters
    differ from a 32-true fit of the same batches."""
    captured, _, batches = captured_and_eager
    reference = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, warmup_steps=1,
                              cuda_graph=False)
    reference.load_state_dict(captured.state_dict())
    dtypes = []
    captured.model.lm_head.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    _fit(captured, batches, "bf16-mixed")
    _fit(reference, batches, "32-true")
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert not torch.equal(captured.model.lm_head.weight, reference.model.lm_head.weight)


def test_capture_is_made_without_the_autocast_weight_cache(monkeypatch):
    """Lightning's autocast keeps its cache on; capture must turn it off or make_graphed_callables refuses."""
    module = LanguageModel(size="tiny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        with cuda_graph._capture_autocast(module):
            assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with cuda_graph._capture_autocast(module):
        assert not torch.is_autocast_enabled("cpu")
