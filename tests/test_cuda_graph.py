"""LanguageModel(cuda_graph=True) on the CPU: the checks that refuse what cannot be captured, and the wiring
(captured callable used for the batches of the captured shape, eager for others with a warning, logged
values copied off the graph's static outputs) with make_graphed_callables replaced by a stand-in that
records its inputs. The capture itself needs a GPU: benchmarks/graph_fit_check.py runs real fits there."""

import lightning as L
import pytest
import torch
from graph_stand_in import captured_and_eager_models

from mhar_lit.lit import cuda_graph
from mhar_lit.lit.module import LanguageModel
from mhar_lit.residual import FullAttnRes


def _fit(module, batches, **trainer_kwargs):
    trainer = L.Trainer(accelerator="cpu", max_steps=len(batches), logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


def test_cpu_run_is_refused_with_every_reason():
    module = LanguageModel(size="tiny", cuda_graph=True, activation_checkpointing=True, warmup_steps=1)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device.*activation_checkpointing is on"):
        _fit(module, [torch.randint(0, 256, (2, 9))])


def test_compile_and_cuda_graph_are_alternatives():
    with pytest.raises(ValueError, match="alternatives"):
        LanguageModel(size="tiny", cuda_graph=True, compile=True)


def test_fp16_autocast_is_refused_and_bf16_autocast_is_not():
    """bf16-mixed is captured (autocast without its weight cache); 16-mixed is not tested under capture."""
    module = LanguageModel(size="tiny", cuda_graph=True)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="autocast to torch.float16"):
        cuda_graph.check_supported(module)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not any("autocast" in p for p in cuda_graph.capture_problems(module))


def test_captured_callable_serves_its_shape_and_other_shapes_run_eagerly(monkeypatch):
    captured = []

    def fake_make_graphed_callables(loss_module, sample_args, allow_unused_input=False):
        captured.append(tuple(a.shape for a in sample_args))
        calls = []

        def graphed(inputs, targets):
            calls.append(inputs.shape)
            return loss_module(inputs, targets)
        graphed.calls = calls
        return graphed

    monkeypatch.setattr(cuda_graph, "check_supported", lambda module: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    torch.manual_seed(0)
    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), cuda_graph=True, z_loss=1e-4,
                           warmup_steps=1)
    eager = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, warmup_steps=1)
    eager.load_state_dict(module.state_dict())
    batches = [torch.randint(0, 256, (2, 9)) for _ in range(3)] + [torch.randint(0, 256, (1, 9))]
    with pytest.warns(UserWarning, match="run eagerly"):
        _fit(module, batches)
    _fit(eager, batches)
    assert captured == [((2, 8), (2, 8))]
    # one call per batch of the captured shape
    assert module._graphed_loss.graphed.calls == [(2, 8)] * 3 and module._graphed_loss.eager_batches == 1
    for (name, p), (_, q) in zip(module.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)  # the same training, step for step


def test_default_captures_where_valid_and_says_why_not_elsewhere(monkeypatch, caplog):
    """cuda_graph None (the default): on the CPU the run trains eagerly and logs the reason once."""
    module = LanguageModel(size="tiny", warmup_steps=1)
    with caplog.at_level("INFO"):
        _fit(module, [torch.randint(0, 256, (2, 9)) for _ in range(2)])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training steps:")]
    assert lines == ["training steps: eager: the model is on cpu, CUDA graphs need a CUDA device"]
    assert module._graphed_loss.decision is False and module._graphed_loss.graphed is None


def test_default_takes_the_captured_path_when_capture_is_valid(monkeypatch):
    """cuda_graph None with nothing against capture: the batches go through the captured callable."""
    calls = []

    def fake_make_graphed_callables(loss_module, sample_args, allow_unused_input=False):
        def graphed(inputs, targets):
            calls.append(inputs.shape)
            return loss_module(inputs, targets)
        return graphed

    monkeypatch.setattr(cuda_graph, "capture_problems", lambda module: [])
    monkeypatch.setattr(cuda_graph, "check_supported", lambda module: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    module = LanguageModel(size="tiny", warmup_steps=1)
    _fit(module, [torch.randint(0, 256, (2, 9)) for _ in range(2)])
    assert module._graphed_loss.decision is True and calls == [(2, 8)] * 2  # one per batch


def test_cuda_graph_false_and_compile_train_eagerly():
    """An explicit `cuda_graph: false`, or `compile: true`, never builds the capture path."""
    assert LanguageModel(size="tiny", cuda_graph=False)._graphed_loss is None
    assert LanguageModel(size="tiny", compile=True)._graphed_loss is None


def _captured_and_eager_after_accumulation(monkeypatch, accumulate: int):
    captured, eager = captured_and_eager_models(monkeypatch)
    batches = [torch.randint(0, 256, (2, 9)) for _ in range(3 * accumulate)]
    for module in (captured, eager):
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=accumulate)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert captured._graphed_loss.decision is True
    return captured, eager


@pytest.mark.parametrize("accumulate", [1, 4])
def test_captured_step_equals_eager_under_gradient_accumulation(monkeypatch, accumulate):
    """Static gradient buffers reused by every replay must not alias .grad across microbatches: after 3 optimizer
    steps of `accumulate` microbatches, captured and eager parameters are identical (same ops, same order)."""
    captured, eager = _captured_and_eager_after_accumulation(monkeypatch, accumulate)
    for (name, p), (_, q) in zip(captured.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_the_stand_in_reproduces_the_aliasing_defect_without_the_copy(monkeypatch):
    """Were the first microbatch's .grad the static buffer itself rather than a copy, the next replay would overwrite
    the running sum: the stand-in's static buffers then corrupt accumulated gradients, so the test above would
    catch a regression."""
    monkeypatch.setattr(cuda_graph, "_copies", lambda tensors: tensors)
    captured, eager = _captured_and_eager_after_accumulation(monkeypatch, 4)
    differs = [name for (name, p), (_, q) in zip(captured.named_parameters(), eager.named_parameters())
               if not torch.equal(p, q)]
    assert len(differs) > len(list(captured.parameters())) // 2, differs


def _count_accumulate_grad_runs(module) -> list[int]:
    runs = [0]
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: runs.__setitem__(0, runs[0] + 1))
    return runs


def _graphs_whose_capture_graph_is_held_elsewhere(monkeypatch):
    from graph_stand_in import static_buffer_graphs

    held = []

    def graphs(loss_module, sample_args, allow_unused_input=False):
        graphed = static_buffer_graphs(loss_module, sample_args, allow_unused_input)
        outputs = graphed.capture_outputs
        held.append((outputs[0] if isinstance(outputs, tuple) else outputs).grad_fn)  # another owner of its graph
        return graphed

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", graphs)
    return held


def test_no_accumulate_grad_node_runs_in_a_captured_step(monkeypatch):
    """make_graphed_callables keeps its captured forward's graph, whose AccumulateGrad nodes belong to the capture
    stream (on a GPU, gradient adds ran there, racing the training stream: NaN under accumulation). The captured
    step adds into .grad itself, so no parameter's AccumulateGrad node runs, even with the capture's graph held
    elsewhere, and the parameters still match eager training exactly; the eager step runs them all."""
    captured, eager = captured_and_eager_models(monkeypatch)
    held = _graphs_whose_capture_graph_is_held_elsewhere(monkeypatch)
    captured_runs, eager_runs = _count_accumulate_grad_runs(captured), _count_accumulate_grad_runs(eager)
    batches = [torch.randint(0, 256, (2, 9)) for _ in range(8)]
    for module in (captured, eager):
        _fit(module, batches, accumulate_grad_batches=4)
    assert held and captured._graphed_loss.decision is True
    # _fit takes max_steps=8 optimizer steps, 4 microbatches each: every parameter's node runs 32 times in eager
    assert captured_runs == [0] and eager_runs == [32 * len(list(eager.parameters()))]
    for (name, p), (_, q) in zip(captured.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
