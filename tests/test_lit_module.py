"""LightningModule pieces that need no data pipeline: schedule, weight-decay groups, checkpoint identity."""

import math

import pytest
import torch

from mhar_lit.lit.module import LanguageModel, lr_factor, model_from_checkpoint
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, StandardResidual


def test_lr_schedule_matches_paper_formula():
    """Warmup to the peak, then lr(t) = peak [rho + (1 - rho) 1/2 (1 + cos(pi (t - W) / (S - W)))] (docs/method.md H.1)."""
    warmup, total, rho = 1000, 20000, 0.1
    assert lr_factor(0, warmup, total, rho) == pytest.approx(1 / 1000)
    assert lr_factor(999, warmup, total, rho) == pytest.approx(1.0)
    for t in (1000, 5000, 10500, 19999, 20000, 25000):
        expected = rho + (1 - rho) * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - warmup) / (total - warmup))))
        assert lr_factor(t, warmup, total, rho) == pytest.approx(expected)
    assert lr_factor(20000, warmup, total, rho) == pytest.approx(rho)


def test_weight_decay_groups():
    """Paper: one group decays everything. Option: norms, embeddings, gates, null sources, key norms excluded."""
    every = LanguageModel(size="tiny", residual=DeltaAttnRes(heads=4, layers_per_block=1))
    groups = every.parameter_groups()
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    assert sum(p.numel() for p in groups[0]["params"]) == every.model.num_parameters()

    module = LanguageModel(size="tiny", residual=DeltaAttnRes(heads=4, layers_per_block=1), decay_all_parameters=False)
    decay, no_decay = module.parameter_groups()
    names = {id(p): n for n, p in module.model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert {"embed_tokens.weight", "norm.weight", "residual.gate", "residual.null", "residual.key_norm"} <= no_decay_names
    assert "layers.0.input_layernorm.weight" in no_decay_names and "layers.1.self_attn.k_norm.weight" in no_decay_names
    assert "residual.query" in decay_names and "layers.0.mlp.up_proj.weight" in decay_names  # docs/method.md J11: q decayed
    assert not decay_names & no_decay_names
    assert len(decay_names) + len(no_decay_names) == len(list(module.model.parameters()))


def _save(module, path):
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": {}}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return ckpt


def test_checkpoint_from_another_strategy_or_size_is_a_clear_error(tmp_path):
    ckpt = _save(LanguageModel(size="tiny", residual=FullAttnRes(heads=4)), tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        LanguageModel(size="tiny", residual=FullAttnRes(heads=2)).on_load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="checkpoint model_config does not match this run"):
        LanguageModel(size="tiny-4l", residual=FullAttnRes(heads=4)).on_load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="not written by mhar_lit"):
        LanguageModel(size="tiny").on_load_checkpoint({"state_dict": {}})
    LanguageModel(size="tiny", residual=FullAttnRes(heads=4)).on_load_checkpoint(ckpt)  # same: ok
    # files written before init_args was the key stored "options" (with the routing speed options strategies took
    # then): still the same strategy
    ckpt["mhar_lit"]["residual"] = {"class_path": "mhar_lit.residual.attnres.FullAttnRes",
                                    "options": {"heads": 4, "random_query_init": False, "eps": 1e-6,
                                                "backend": "triton", "triton_options": {}}}
    LanguageModel(size="tiny", residual=FullAttnRes(heads=4)).on_load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        LanguageModel(size="tiny", residual=FullAttnRes(heads=2)).on_load_checkpoint(ckpt)


def test_model_from_checkpoint_round_trip(tmp_path):
    """The checkpoint alone rebuilds strategy, config and weights (weights_only load), same logits."""
    torch.manual_seed(0)
    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=2, random_query_init=True))
    _save(module, tmp_path / "m.ckpt")
    model = model_from_checkpoint(str(tmp_path / "m.ckpt"))
    assert model.residual.to_config() == module.model.residual.to_config()
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x), module.model.eval()(x))
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        model_from_checkpoint(str(tmp_path / "missing.ckpt"))


def test_z_loss_and_loss_values():
    """Training loss is the mean token cross-entropy; z-loss adds weight x mean(logsumexp^2)."""
    torch.manual_seed(0)
    module = LanguageModel(size="tiny", residual=StandardResidual(), z_loss=1e-4)
    batch = torch.randint(0, module.config.vocab_size, (2, 11))
    ce, z, tokens = module._loss(batch)
    logits = module.model(batch[:, :-1]).float()
    assert tokens == 20
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
    torch.testing.assert_close(z, torch.logsumexp(logits, -1).pow(2).mean())
    assert ce.item() == pytest.approx(math.log(module.config.vocab_size), abs=0.1)  # init logits are near-uniform


@pytest.mark.parametrize("setting,value,expected", [
    ("lr", 0.0, "model.lr must be > 0"),
    ("min_lr_ratio", -2.0, r"model.min_lr_ratio must be in \[0, 1\]"),
    ("min_lr_ratio", 1.5, r"model.min_lr_ratio must be in \[0, 1\]"),
    ("tail_k", 0, "model.tail_k must be >= 1"),
    ("tail_k", -1, "model.tail_k must be >= 1"),
    ("weight_decay", -1.0, "model.weight_decay must be >= 0"),
    ("warmup_steps", -3, "model.warmup_steps must be >= 0"),
    ("decay_steps", -1, "model.decay_steps must be >= 0"),
    ("grad_clip", -1.0, "model.grad_clip must be >= 0"),
    ("z_loss", -1e-4, "model.z_loss must be >= 0"),
    ("eps", 0.0, "model.eps must be > 0"),
    ("betas", (0.9, 1.0), r"model.betas must be two values in \[0, 1\)"),
])
def test_settings_that_would_train_silently_wrong_are_refused(setting, value, expected):
    """Each would have trained without an error (a negative lr from min_lr_ratio < 0, no warmup from a negative
    warmup, clipping off from a negative grad_clip, a tail mean over every validation from tail_k 0)."""
    with pytest.raises(ValueError, match=expected):
        LanguageModel(size="tiny", **{setting: value})


def test_unknown_model_override_names_the_key():
    with pytest.raises(ValueError, match=r"unknown model config keys \['hidden'\]; known keys: .*hidden_size"):
        LanguageModel(size="tiny", model_overrides={"hidden": 32})


def test_tokenizer_larger_than_the_vocab_is_a_clear_error():
    """setup names the override to set when the data's tokenizer has more ids than the model's embedding; the tiny
    sizes cover the byte tokenizer (257 ids) as they are."""
    from types import SimpleNamespace

    def setup_with(module, vocab):
        module.trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=vocab))
        module.setup("fit")

    for size in ("tiny", "tiny-4l"):
        setup_with(LanguageModel(size=size, residual=StandardResidual()), 257)
    with pytest.raises(ValueError, match=r"tokenizer has 400 ids .* model.model_overrides.vocab_size >= 400"):
        setup_with(LanguageModel(size="tiny", residual=StandardResidual()), 400)
    setup_with(LanguageModel(size="tiny", residual=StandardResidual(), model_overrides={"vocab_size": 400}), 400)


def test_validation_metric_keeps_full_precision_under_bf16_true():
    """bf16-true casts the module; the validation mean must still not be rounded to bf16 (0.008 steps at 1.5)."""
    module = LanguageModel(size="tiny").to(torch.bfloat16)
    module.on_validation_epoch_start()
    module.val_loss.update(torch.tensor(1.5100), weight=10)
    module.val_loss.update(torch.tensor(1.5200), weight=30)
    assert module.val_loss.compute().item() == pytest.approx(1.5175, abs=1e-6)  # fp32 inputs: 1e-7 relative


def test_state_dict_holds_each_weight_once():
    """No alias module paths: a checkpoint stores the decoder once (it used to store it twice)."""
    for compile_ in (False, True):
        module = LanguageModel(size="tiny", residual=FullAttnRes(heads=2), compile=compile_)
        keys = list(module.state_dict())
        assert all(k.startswith("model.") for k in keys), keys[:3]
        assert len(keys) == len(module.model.state_dict())


def test_triton_tuning_knobs_do_not_change_checkpoint_identity():
    full = FullAttnRes(heads=4)
    full.set_routing_backend("triton", {"chunk": 4, "group": 8})
    a, b = full.identity(), FullAttnRes(heads=4).identity()
    assert a == b and a["init_args"]["heads"] == 4
    block = BlockAttnRes(heads=4, layers_per_block=2)
    block.set_routing_backend("triton", {"num_warps": 4})
    a, b = block.identity(), BlockAttnRes(heads=4, layers_per_block=2, two_phase=True).identity()
    assert a == b and a["init_args"] == {"heads": 4, "layers_per_block": 2, "num_blocks": None,
                                         "random_query_init": False, "eps": 1e-6, "logit_scale": None,
                                         "routing_lr_scale": 1.0}


def test_compare_pairs_only_same_seed_and_lr():
    from mhar_lit.sweep import add_paired_deltas

    rows = [
        {"method": "StandardResidual", "seed": "1", "lr": "0.001", "tail_mean": 3.0},
        {"method": "FullAttnRes(heads=8)", "seed": "1", "lr": "0.001", "tail_mean": 2.9},
        {"method": "FullAttnRes(heads=8)", "seed": "1", "lr": "0.002", "tail_mean": 2.8},  # no baseline at this lr
        {"method": "FullAttnRes(heads=8)", "seed": "2", "lr": "0.001", "tail_mean": 2.7},  # no baseline at this seed
    ]
    add_paired_deltas(rows, "tail_mean")
    assert rows[0]["delta"] == 0.0 and rows[1]["delta"] == pytest.approx(-0.1)
    assert math.isnan(rows[2]["delta"]) and math.isnan(rows[3]["delta"])
