"""model.fused_loss: the chunked LM head + liger cross-entropy kernel (Triton's interpreter on CPU tensors,
tests/conftest.py) against the plain loss (F.cross_entropy of the fp32-cast logits, z = mean logsumexp^2) and
against liger's own LigerFusedLinearCrossEntropyLoss; through LanguageModel eagerly and on a CPU stand-in of the
captured step.

Tolerances. fp32: the kernel's online softmax and the chunked dW sum add in another order than the plain path,
so values agree to a few fp32 ulps of the largest term: rtol 1e-5, atol 1e-6 (observed: gradients within 1e-6 of
their largest entry, 2e-8 absolute). bf16 parameters:
both paths round the logits gradient to bf16 before the products (2^-8 relative), the plain path rounds dW once
and the fused one per chunk: atol 2e-2 of the largest gradient entry."""

import json
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from mhar_lit.kernels.linear_cross_entropy import fused_linear_cross_entropy
from mhar_lit.lit import cuda_graph
from mhar_lit.lit.module import LanguageModel
from mhar_lit.residual import FullAttnRes
from graph_stand_in import static_buffer_graphs


def plain_loss(hidden, weight, targets, z_weight):
    logits = (hidden @ weight.t()).float()
    ce = F.cross_entropy(logits, targets)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean() if z_weight else logits.new_zeros(())
    return ce, z


def loss_and_grads(loss_fn, hidden, weight, targets, z_weight, scale=1.0, **kwargs):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    ce, z = loss_fn(hidden, weight, targets, z_weight, **kwargs)
    (scale * (ce + z_weight * z)).backward()  # scale: as Lightning divides by accumulate_grad_batches
    return ce.detach(), z.detach(), hidden.grad, weight.grad


def draw(rows=19, dim=16, vocab=300, dtype=torch.float32):
    hidden = torch.randn(rows, dim).to(dtype)
    weight = (0.3 * torch.randn(vocab, dim)).to(dtype)
    return hidden, weight, torch.randint(0, vocab, (rows,))


@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_fused_loss_and_gradients_equal_the_plain_ones_in_fp32(z_weight):
    """Loss, z and both gradients equal the plain path's, over uneven chunks (19 rows in chunks of 8), with an
    upstream gradient other than 1."""
    hidden, weight, targets = draw()
    fused = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, z_weight, scale=0.3, chunk=8)
    plain = loss_and_grads(plain_loss, hidden, weight, targets, z_weight, scale=0.3)
    for name, f, p in zip(("ce", "z", "d hidden", "d weight"), fused, plain):
        torch.testing.assert_close(f, p, rtol=1e-5, atol=1e-6, msg=name)
    assert fused[3].dtype == torch.float32 and fused[2].dtype == torch.float32


def test_fused_loss_equals_liger_fused_linear_cross_entropy():
    """The same kernel as liger's own module: its loss (ce + z-loss included) and gradients, to fp32 rounding."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    hidden, weight, targets = draw()
    z_weight = 1e-2
    ce, z, d_hidden, d_weight = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, z_weight, chunk=8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    theirs = LigerFusedLinearCrossEntropyLoss(lse_square_scale=z_weight, return_z_loss=True)(w, h, targets)
    theirs.loss.backward()
    torch.testing.assert_close(ce + z_weight * z, theirs.loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z_weight * z, theirs.z_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(d_hidden, h.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(d_weight, w.grad, rtol=1e-5, atol=1e-7)


def test_bf16_parameters_match_the_plain_path_within_bf16_rounding():
    hidden, weight, targets = draw(dtype=torch.bfloat16)
    fused = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, 1e-2, chunk=8)
    plain = loss_and_grads(plain_loss, hidden, weight, targets, 1e-2)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 loss
    for f, p in zip(fused[2:], plain[2:]):
        assert f.dtype == torch.bfloat16
        assert (f.float() - p.float()).abs().max() <= 2e-2 * p.float().abs().max()


def test_under_bf16_autocast_the_matmuls_are_bf16_and_the_weight_gradient_fp32():
    """bf16-mixed: fp32 weights, bf16 products (the plain path's autocast lm_head), fp32 gradients."""
    hidden, weight, targets = draw()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets, 1e-2, chunk=8)
        plain = loss_and_grads(plain_loss, hidden, weight, targets, 1e-2)
    assert fused[2].dtype == fused[3].dtype == torch.float32
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    for f, p in zip(fused[2:], plain[2:]):
        assert (f - p).abs().max() <= 2e-2 * p.abs().max()
    exact = loss_and_grads(plain_loss, hidden, weight, targets, 1e-2)  # fp32: the products were not fp32
    assert (fused[0] - exact[0]).abs() > 1e-6


def test_without_gradients_the_loss_is_the_same():
    hidden, weight, targets = draw()
    with torch.no_grad():
        ce, z = fused_linear_cross_entropy(hidden, weight.requires_grad_(), targets, 1e-2, chunk=8)
    assert ce.grad_fn is None
    torch.testing.assert_close((ce, z), plain_loss(hidden, weight.detach(), targets, 1e-2), rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"expected hidden \[N, D\] and targets \[N\]"):
        fused_linear_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long))


def _language_models(**kwargs):
    torch.manual_seed(0)
    fused = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, fused_loss=True, **kwargs)
    plain = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, **kwargs)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def test_language_model_fused_loss_trains_the_same_function():
    """LanguageModel._loss with fused_loss: ce, z and every parameter's gradient equal the plain path's (MHAR, z-loss,
    tied lm_head excluded: the tiny size is untied)."""
    fused, plain = _language_models()
    batch = torch.randint(0, 256, (2, 17))
    grads = []
    for module in (fused, plain):
        ce, z, tokens = module._loss(batch)
        (ce + module.hparams.z_loss * z).backward()
        grads.append(({n: p.grad for n, p in module.named_parameters()}, ce.detach(), z.detach(), tokens))
    (g_fused, *out_fused), (g_plain, *out_plain) = grads
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-6)
    assert g_fused.keys() == g_plain.keys()
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_captured_fused_step_equals_the_eager_fused_step_under_accumulation(monkeypatch):
    """The fused loss inside the captured unit (stand-in) trains exactly as eagerly: 2 optimizer steps of 2
    microbatches, parameters bitwise equal."""
    monkeypatch.setattr(cuda_graph, "capture_problems", lambda module: [])
    monkeypatch.setattr(cuda_graph, "check_supported", lambda module: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", static_buffer_graphs)
    torch.manual_seed(0)
    captured = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, fused_loss=True, warmup_steps=1)
    eager = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), z_loss=1e-4, fused_loss=True, warmup_steps=1,
                          cuda_graph=False)
    eager.load_state_dict(captured.state_dict())
    batches = [torch.randint(0, 256, (2, 9)) for _ in range(4)]
    for module in (captured, eager):
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=2)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert captured._graphed_loss.decision is True and captured._graphed_loss.graphed is not None
    for (name, p), (_, q) in zip(captured.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_cli_fit_with_fused_loss_and_bf16_mixed(tmp_path, monkeypatch):
    """The two options as a user sets them in a config: a real fit (eager on the CPU) trains, validates through the
    fused loss, and keeps fp32 parameters."""
    from mhar_lit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"),
                     "--model.size", "tiny", "--model.fused_loss", "true", "--model.z_loss", "1e-4",
                     "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "2",
                     "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
                     "--data.max_corpus_bytes", "60000", "--data.seq_len", "32", "--data.batch_size", "2",
                     "--data.val_batch_size", "2", "--data.val_fraction", "0.3",
                     "--data.cache_dir", str(tmp_path / "cache"),
                     "--routing_monitor.every_n_steps", "100"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    metrics = dict(cli.trainer.callback_metrics)
    metrics.update(cli.trainer.validate(cli.model, cli.datamodule)[0])
    assert cli.model.hparams.fused_loss and cli.trainer.precision == "bf16-mixed"
    assert all(torch.isfinite(torch.as_tensor(metrics[k])) and metrics[k] > 0
               for k in ("train/loss", "train/z_loss", "val/loss"))
    assert {p.dtype for p in cli.model.parameters()} == {torch.float32}


def _load_benchmark(name):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmarks_run_their_cpu_checks(tmp_path, monkeypatch):
    """benchmarks/fused_loss_check.py and peer_step.py's fused variant, at the tiny shape on the CPU: the plumbing
    the GPU runs use, with the fused loss within bf16 rounding of the plain one and the same first step loss."""
    report = _load_benchmark("fused_loss_check").main(["--device", "cpu", "--sizes", "tiny", "--iters", "1",
                                                       "--out", str(tmp_path / "check.json")])
    assert set(report["results"]) == {"tiny bf16-true", "tiny bf16-mixed"} and not report["skipped"]
    for row in report["results"].values():
        assert max(row["fused_vs_plain"].values()) < 2e-2 and row["fused_ms"] > 0 and row["plain_ms"] > 0
    # each variant in a child process of its own (the GPU suite's memory-safe mode), joined into one report; the
    # children run here in this process (a child's interpreter start would cost more than the check itself)
    peer_step = _load_benchmark("peer_step")
    real_run = subprocess.run

    def run_child_here(cmd, **kwargs):
        if not str(cmd[1]).endswith("peer_step.py"):
            return real_run(cmd, **kwargs)
        peer_step.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run_child_here)
    peer = peer_step.main(["--device", "cpu", "--sizes", "tiny", "--variants", "ours", "ours_fused",
                                              "--dtype", "fp32", "--rounds", "1", "--steps", "1", "--warmup", "1",
                                              "--one-per-process", "--out", str(tmp_path / "peer.json")])
    variants = peer["sizes"][0]["variants"]
    assert variants["ours_fused"]["first_loss"] == pytest.approx(variants["ours"]["first_loss"], rel=1e-5)
    assert peer["sizes"][0]["reference"] == "ours" and variants["ours"]["vs_ours"] == 1.0
    assert json.loads((tmp_path / "peer.json").read_text())["sizes"] == peer["sizes"]
    assert sorted(p.name for p in tmp_path.glob("peer*.json")) == ["peer.json"]  # the children's reports removed


def test_peer_step_joins_one_variant_reports_and_refuses_different_shapes():
    peer = _load_benchmark("peer_step")
    row = lambda speed, params: {"tokens_per_s": speed, "parameters": params, "vs_x": 1.0}  # noqa: E731
    children = [{"sizes": [{"size": "100M", "variants": {"litgpt": row(80.0, 10)}, "litgpt_vs_ours_logit_error": 1e-6}]},
                {"sizes": [{"size": "100M", "variants": {"ours": row(40.0, 10)}}]}]
    [joined] = peer.join_variant_reports(children)
    assert joined["reference"] == "ours" and joined["litgpt_vs_ours_logit_error"] == 1e-6
    assert joined["variants"]["litgpt"] == {"tokens_per_s": 80.0, "parameters": 10, "vs_ours": 2.0}
    children[1]["sizes"][0]["variants"]["ours"]["parameters"] = 11
    with pytest.raises(SystemExit, match="parameter counts differ"):
        peer.join_variant_reports(children)
    assert peer.strip_options(["--sizes", "100M", "1B", "--variants", "a", "b", "--one-per-process", "--rounds=2"],
                              ("--variants", "--one-per-process")) == ["--sizes", "100M", "1B", "--rounds=2"]


def test_the_fused_loss_check_reads_the_shipped_recipes_shapes():
    """The GPU check times the LM head of each paper recipe: its micro-batch tokens, width and vocabulary."""
    check = _load_benchmark("fused_loss_check")
    assert check.shape_of("100M") == (8 * 2048, 512, 151936)
    assert check.shape_of("350M") == (4 * 1024, 1024, 151936) and check.shape_of("1B") == (2 * 1024, 1280, 151936)


def test_fused_loss_with_fsdp_is_refused():
    """FSDP gathers the LM head's weight for its forward only; the fused loss reads it outside, so it is refused."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from mhar_lit.errors import UserError

    module = LanguageModel(size="tiny", fused_loss=True)
    module._trainer = SimpleNamespace(strategy=FSDPStrategy(), datamodule=None)
    with pytest.raises(UserError, match="model.fused_loss reads lm_head.weight outside"):
        module.setup("fit")
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(), datamodule=None)
    module.setup("fit")  # one device: accepted
