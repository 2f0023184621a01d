"""RoutingMonitor's statistics against hand-computed cases: per-token entropy, logit spread, the metric set."""

import math

import pytest
import torch

from mhar_lit.config import ModelConfig
from mhar_lit.lit.callbacks import SiteRouting, collect_routing, routing_metrics, site_routing
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import FullAttnRes
from mhar_lit.routing import routing_weights

# D 4, H 2, eps 0, q = (1, 2, 3, 4), g = 1; unit-RMS keys k_a = (1, -1, 1, -1), k_b = (2, 0, 0, 0):
# head logits of k_a (-1, -1), of k_b (2, 0) (tests/test_routing_options.py works them out).
K_A, K_B = [1.0, -1.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0]
Q, G = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), torch.ones(4, dtype=torch.float64)


def _entropy_bits(logits):
    p = torch.tensor(logits, dtype=torch.float64).softmax(0)
    return float(-(p * p.log()).sum() / math.log(len(logits)))


def test_per_token_entropy_and_spread_by_hand():
    """Token 0 has sources (k_a, k_b), token 1 (k_b, k_a): head 0 logits (-1, 2) then (2, -1), head 1 (-1, 0)
    then (0, -1). Each token is equally sharp, so the per-token entropy is H(softmax(-1, 2)) / log 2 for head
    0 (0.2754), H(softmax(-1, 0)) / log 2 for head 1 (0.8399); the token-averaged weights are exactly uniform
    (their entropy would read 1: the reason the monitor averages per-token entropies)."""
    sources = torch.tensor([[K_A, K_B], [K_B, K_A]], dtype=torch.float64).view(2, 1, 2, 4)  # [N, B, T, D]
    stats = site_routing(sources, Q, G, heads=2, eps=0.0)
    expected = torch.tensor([_entropy_bits([-1.0, 2.0]), _entropy_bits([-1.0, 0.0])])
    assert expected[0] == pytest.approx(0.2753600, abs=1e-6) and expected[1] == pytest.approx(0.8399416, abs=1e-6)
    torch.testing.assert_close(stats.token_entropy_H, expected.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats.logit_spread_H, torch.tensor([3.0, 1.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(stats.mean_weights_NH, torch.full((2, 2), 0.5), rtol=0, atol=1e-7)


def test_metrics_skip_single_source_sites_and_average_the_rest():
    one = SiteRouting(torch.zeros(2), torch.zeros(2), torch.ones(1, 2))
    a = SiteRouting(torch.tensor([0.2, 0.4]), torch.tensor([1.0, 3.0]), torch.full((2, 2), 0.5))
    b = SiteRouting(torch.tensor([1.0, 0.8]), torch.tensor([0.0, 0.0]), torch.full((3, 2), 1 / 3))
    metrics = routing_metrics({0: one, 1: a, 12: b})
    assert set(metrics) == {"routing/entropy_site01", "routing/entropy_site12", "routing/entropy",
                            "routing/logit_spread"}
    assert metrics["routing/entropy_site01"] == pytest.approx(0.3)
    assert metrics["routing/entropy_site12"] == pytest.approx(0.9)
    assert metrics["routing/entropy"] == pytest.approx(0.6)
    assert metrics["routing/logit_spread"] == pytest.approx(1.0)
    assert routing_metrics({0: one}) == {}


def test_uniform_routing_reads_one_and_a_model_pass_matches_the_reference():
    """Zero queries (the init) route uniformly: entropy 1, spread 0 at every site. With random queries and a
    logit scale, the monitor's weights are the reference weights of the effective query."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig.from_name("tiny"), FullAttnRes(heads=4, logit_scale="sqrt_heads"))
    ids = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(1))
    holder = type("M", (), {"model": model})()
    collected = collect_routing(holder, ids)
    assert sorted(collected) == list(range(5))
    for site in range(1, 5):
        torch.testing.assert_close(collected[site].token_entropy_H, torch.ones(4), rtol=0, atol=1e-6)
        assert collected[site].logit_spread_H.abs().max() == 0
    with torch.no_grad():
        model.residual.query.normal_()
    captured = {}
    model.residual.source_observer = lambda site, s: captured.setdefault(site, s)
    with torch.no_grad():
        model(ids)
    collected = collect_routing(holder, ids)
    assert model.residual.source_observer is not None  # the previous observer is put back
    model.residual.source_observer = None
    r = model.residual
    w = routing_weights(captured[4].double(), 2.0 * r.query[4].detach().double(), r.key_norm[4].detach().double(),
                        4, r.eps)
    torch.testing.assert_close(collected[4].mean_weights_NH, w.mean(dim=(1, 2)).float(), rtol=1e-5, atol=1e-6)
    entropy = (-(w * w.log()).sum(0)).mean(dim=(0, 1)) / math.log(5)
    torch.testing.assert_close(collected[4].token_entropy_H, entropy.float(), rtol=1e-5, atol=1e-6)
    assert collected[4].token_entropy_H.max() < 1.0
