"""The two options beyond the paper that let per-head routing learn at the single-head rate (docs/method.md
"Beyond the paper: routing learning rate"): RoutedResidual(logit_scale=...) and
RoutedResidual(routing_lr_scale=...), which LanguageModel's optimiser reads. Off by default, where they must leave
the computation bit for bit as it was."""

from types import SimpleNamespace

import pytest
import torch

from mhar_lit.lit.module import LanguageModel
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.config import ModelConfig
from mhar_lit.residual import BlockAttnRes, FullAttnRes, StandardResidual
from mhar_lit.routing import routing_logits, routing_weights


def _model(seed=0, **options):
    torch.manual_seed(seed)
    return DecoderLM(ModelConfig.from_name("tiny"), FullAttnRes(heads=4, **options))


def _randomise_queries(model, seed=1):
    with torch.no_grad():
        model.residual.query.copy_(torch.randn(model.residual.query.shape, generator=torch.Generator().manual_seed(seed)))


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


IDS = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("explicit", [{"logit_scale": None}, {"logit_scale": 1.0}, {"logit_scale": 1}])
def test_default_logit_scale_is_bitwise_the_paper(explicit):
    plain, scaled = _model(), _model(**explicit)
    for m in (plain, scaled):
        _randomise_queries(m)  # zero queries would hide a factor
    assert scaled.residual.effective_query() is scaled.residual.query  # no extra op on the default path
    logits_a, grads_a = _loss_and_grads(plain, IDS)
    logits_b, grads_b = _loss_and_grads(scaled, IDS)
    assert torch.equal(logits_a, logits_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_checkpoints_written_before_logit_scale_still_resume():
    """A checkpoint's strategy without the logit_scale key (written before the option) trained at scale 1."""
    module = LanguageModel(size="tiny", residual=FullAttnRes(heads=4))
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": {}}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["mhar_lit"]["residual"]["init_args"]["logit_scale"] is None
    del checkpoint["mhar_lit"]["residual"]["init_args"]["logit_scale"]
    LanguageModel(size="tiny", residual=FullAttnRes(heads=4)).on_load_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        LanguageModel(size="tiny", residual=FullAttnRes(heads=4, logit_scale="heads")).on_load_checkpoint(checkpoint)


def test_routing_logits_by_hand():
    """Frozen values of the reference math: D 4, H 2, two sources of unit RMS (eps 0), q = (1, 2, 3, 4).
    k_0 = (1, -1, 1, -1): head logits (1 - 2, 3 - 4) = (-1, -1); k_1 = (2, 0, 0, 0): (2, 0). At logit scale c
    every logit is c times these."""
    sources = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0]], dtype=torch.float64).view(2, 1, 1, 4)
    q, g = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    expected = torch.tensor([[-1.0, -1.0], [2.0, 0.0]], dtype=torch.float64)
    assert torch.equal(routing_logits(sources, q, g, heads=2, eps=0.0).view(2, 2), expected)
    strategy = FullAttnRes(heads=2, eps=0.0, logit_scale="heads")
    strategy.query = torch.nn.Parameter(q.view(1, 4).clone())
    assert strategy.logit_factor == 2.0
    scaled = routing_logits(sources, strategy.effective_query()[0], g, heads=2, eps=0.0).view(2, 2)
    assert torch.equal(scaled, 2.0 * expected)


@pytest.mark.parametrize("setting, factor", [(2.5, 2.5), ("sqrt_heads", 2.0), ("heads", 4.0)])
def test_logit_scale_multiplies_every_sites_logits(setting, factor):
    """Through the model: the logits the router sees at every site are c x the unscaled ones (checked with
    routing_logits on the captured sources); the model with scale c and query q computes exactly what the
    unscaled model computes with query c q, and autograd gives the scaled model's query c x that gradient."""
    scaled, plain = _model(logit_scale=setting), _model()
    _randomise_queries(scaled)
    with torch.no_grad():
        plain.residual.query.copy_(scaled.residual.query * factor)
    assert scaled.residual.logit_factor == pytest.approx(factor)
    captured = {}
    scaled.residual.source_observer = lambda site, sources: captured.setdefault(site, sources)
    logits_s, grads_s = _loss_and_grads(scaled, IDS)
    scaled.residual.source_observer = None
    logits_p, grads_p = _loss_and_grads(plain, IDS)
    assert torch.equal(logits_s, logits_p)
    torch.testing.assert_close(grads_s["residual.query"], factor * grads_p["residual.query"], rtol=1e-5, atol=1e-7)
    r = scaled.residual
    assert len(captured) == 2 * 2 + 1
    for site, sources in captured.items():
        q, g = r.query[site].detach().double(), r.key_norm[site].detach().double()
        eff = r.effective_query()[site].detach().double()
        unscaled = routing_logits(sources.double(), q, g, r.heads, r.eps)
        # fp64 math on the fp32 effective query: c q is rounded to fp32 once (exact for c = 2, 4)
        tol = 1e-12 if factor in (2.0, 4.0) else 1e-5
        torch.testing.assert_close(routing_logits(sources.double(), eff, g, r.heads, r.eps), factor * unscaled,
                                   rtol=tol, atol=tol)
    # the routing monitor computes its weights with the same effective query as the router
    from mhar_lit.lit.callbacks import collect_routing

    site, sources = 3, captured[3]
    expected = routing_weights(sources.double(), r.effective_query()[site].detach().double(),
                               r.key_norm[site].detach().double(), r.heads, r.eps).mean(dim=(1, 2)).float()
    monitored = collect_routing(SimpleNamespace(model=scaled), IDS)[site].mean_weights_NH
    torch.testing.assert_close(monitored, expected, rtol=1e-5, atol=1e-6)


def test_block_mode_takes_logit_scale_and_bad_values_are_refused():
    assert BlockAttnRes(heads=4, layers_per_block=1, logit_scale="sqrt_heads").logit_factor == 2.0
    assert BlockAttnRes(heads=4, layers_per_block=1, logit_scale=3.0).to_config()["init_args"]["logit_scale"] == 3.0
    for bad in ("sqrt", 0.0, -1.0, True, float("nan"), [2.0]):
        with pytest.raises(ValueError, match="logit_scale must be null, a positive number"):
            FullAttnRes(heads=4, logit_scale=bad)


# ---------------------------------------------------------------- routing_lr_scale
def _module(seed=0, routing_lr_scale=1.0, **options):
    torch.manual_seed(seed)
    return LanguageModel(size="tiny", residual=FullAttnRes(heads=4, routing_lr_scale=routing_lr_scale), lr=1e-3,
                         warmup_steps=1, decay_steps=10, **options)


def _train(module, steps=2):
    optim_config = module.configure_optimizers()
    optimizer, schedule = optim_config["optimizer"], optim_config["lr_scheduler"]["scheduler"]
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        optimizer.zero_grad()
        ce, _, _ = module._loss(ids)
        ce.backward()
        optimizer.step()
        schedule.step()
    return optimizer


def test_default_routing_lr_scale_is_bitwise_the_paper():
    plain, explicit = _module(), _module(routing_lr_scale=1.0)
    opt_a, opt_b = _train(plain), _train(explicit)
    assert len(opt_a.param_groups) == len(opt_b.param_groups) == 1
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for index, entry in state_a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state_b["state"][index][key]), (index, key)
    for (name, a), b in zip(plain.named_parameters(), explicit.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("decay_all", [True, False])
def test_routing_lr_scale_gives_the_queries_their_own_group(decay_all):
    module = _module(routing_lr_scale=8.0, decay_all_parameters=decay_all)
    optimizer = module.configure_optimizers()["optimizer"]
    routing = optimizer.param_groups[-1]
    query = module.model.residual.query
    assert len(routing["params"]) == 1 and routing["params"][0] is query
    assert routing["initial_lr"] == pytest.approx(8.0 * 1e-3) and routing["weight_decay"] == 0.1
    others = [p for g in optimizer.param_groups[:-1] for p in g["params"]]
    assert all(p is not query for p in others)
    assert len(others) + 1 == len(list(module.model.parameters()))
    assert all(g["initial_lr"] == 1e-3 for g in optimizer.param_groups[:-1])


def test_routing_lr_scale_moves_the_queries_that_much_faster():
    """Adam's first update is lr x sign(g) (up to eps) and zero queries see no weight decay: with scale 8 the
    queries move 8 x as far in the first step, every other parameter exactly as far."""
    base, fast = _module(), _module(routing_lr_scale=8.0)
    q0 = base.model.residual.query.detach().clone()
    _train(base, steps=1), _train(fast, steps=1)
    moved_base = base.model.residual.query.detach() - q0
    moved_fast = fast.model.residual.query.detach() - q0
    assert moved_base.abs().max() > 0
    torch.testing.assert_close(moved_fast, 8.0 * moved_base, rtol=1e-4, atol=1e-9)
    for (name, a), b in zip(base.model.named_parameters(), fast.model.parameters()):
        if name != "residual.query":
            assert torch.equal(a, b), name


def test_routing_lr_scale_needs_trainable_queries_and_a_positive_value():
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="routing_lr_scale must be a positive number"):
            FullAttnRes(heads=4, routing_lr_scale=bad)
    with pytest.raises(TypeError):  # a strategy without routing does not take the option (the CLI refuses it too)
        StandardResidual(routing_lr_scale=2.0)
    module = _module(routing_lr_scale=2.0)
    module.model.residual.query.requires_grad_(False)
    with pytest.raises(ValueError, match=r"routing_lr_scale 2.0: FullAttnRes\(heads=4, routing_lr_scale=2.0\) has no "
                                         "trainable routing parameters"):
        module.configure_optimizers()


def _checkpoint_of(module):
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    return checkpoint


def test_a_changed_routing_lr_scale_is_refused_on_resume():
    """Part of the strategy's identity: the optimizer state would restore the checkpoint's groups and lrs (or fail
    on their number). A checkpoint written before the option existed trained with 1.0."""
    saved = _checkpoint_of(_module(routing_lr_scale=8.0))
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        _module(routing_lr_scale=4.0).on_load_checkpoint(saved)
    _module(routing_lr_scale=8.0).on_load_checkpoint(saved)  # same: fine
    older = _checkpoint_of(_module())
    del older["mhar_lit"]["residual"]["init_args"]["routing_lr_scale"]
    _module().on_load_checkpoint(older)
    with pytest.raises(ValueError, match="checkpoint residual does not match this run"):
        _module(routing_lr_scale=8.0).on_load_checkpoint(older)
