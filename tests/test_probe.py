"""The query probe (docs/method.md G): its math against hand-computed answers, the source capture, and the CLI end to end.

Shape legend: N sources, B sequences, T positions, D width, S slices, H heads, R draws.
"""

import json
import math
import os

import numpy as np
import pytest
import torch

from mhar_lit.analysis.capture import capture_sources, observe_sources, routed_residual
from mhar_lit.analysis.metrics import (
    head_weights,
    matched_norm_queries,
    mean_pairwise_cosine,
    pearson,
    routing_keys,
    slice_logits,
    width_disagreement_kl,
)
from mhar_lit.analysis.probe import probe_main, probe_model
from mhar_lit.analysis.stats import RoutingStats
from mhar_lit.config import ModelConfig
from mhar_lit.models.decoder import DecoderLM
from mhar_lit.residual import BlockAttnRes, DeltaAttnRes, FullAttnRes, StandardResidual
from mhar_lit.routing import routing_logits, routing_weights

EPS = 1e-6


def _stats_for_one_site(query_D, key_norm_D, heads, slices=4, draws=2):
    """A RoutingStats over a single site 0 (which is also the collinearity site)."""
    null = matched_norm_queries(query_D[None], heads, draws, torch.Generator().manual_seed(0))
    return RoutingStats(query_D[None], key_norm_D[None], heads, slices, null, collinearity_site=0, eps=EPS)


# ---------------------------------------------------------------- the routing math is the model's


@pytest.mark.parametrize("heads", [1, 4])
def test_keys_and_slice_logits_reproduce_the_routing_op(heads):
    g = torch.Generator().manual_seed(1)
    sources, q = torch.randn(5, 2, 3, 16, generator=g), torch.randn(16, generator=g)
    norm = 1 + torch.rand(16, generator=g)
    keys = routing_keys(sources, norm, EPS)
    reference = routing_logits(sources, q, norm, heads, EPS)
    torch.testing.assert_close(slice_logits(keys, q, heads), reference, rtol=0, atol=0)
    torch.testing.assert_close(head_weights(keys, q, heads), routing_weights(sources, q, norm, heads, EPS))
    # The shared (single-head) logit is the sum of the slice logits: the identity the KL relies on.
    torch.testing.assert_close(slice_logits(keys, q, 4).sum(-1), slice_logits(keys, q, 1)[..., 0], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- width-disagreement


def _orthogonal_to(v, rng, size):
    w = rng.standard_normal(size)
    return w - (w @ v) / (v @ v) * v


def test_copied_slices_give_zero_disagreement_when_every_slice_projection_is_equal():
    """q's slices are copies of v; every source slice is c * v/|v| + w with w orthogonal to v and |w| = rho.

    Then every source has the same RMS and every slice logit is c|v|/rms for every source, so each a_s and
    alpha are uniform: KL = 0 exactly. (Zero KL forces this: a_s = alpha for all s means each slice's logits
    are constant over sources; see the next test for copies whose slice projections differ.)
    """
    rng = np.random.default_rng(0)
    slices, m, n, c, rho = 4, 5, 6, 1.3, 0.7
    v = np.array([1.0, -2.0, 0.5, 0.0, 1.5])
    unit = v / np.linalg.norm(v)
    sources = np.zeros((n, 2, 3, slices * m))
    for idx in np.ndindex(n, 2, 3):
        for s in range(slices):
            w = _orthogonal_to(v, rng, m)
            sources[idx][s * m : (s + 1) * m] = c * unit + rho * w / np.linalg.norm(w)
    sources = torch.tensor(sources)
    keys = routing_keys(sources, torch.full((slices * m,), 1.7, dtype=torch.float64), EPS)
    copied = torch.tensor(np.tile(v, slices))
    kl_BT = width_disagreement_kl(keys, copied, slices)
    assert kl_BT.shape == (2, 3)
    assert kl_BT.abs().max() < 1e-12
    torch.testing.assert_close(head_weights(keys, copied, 1), torch.full((n, 2, 3, 1), 1 / n, dtype=torch.float64))
    # Not vacuous: the sources do differ, and a generic query disagrees across the width.
    generic = torch.tensor(rng.standard_normal(slices * m))
    assert width_disagreement_kl(keys, generic, slices).min() > 1e-3


def test_copied_slices_over_copied_source_slices_is_softmax_x_against_softmax_Sx():
    """Slices of q and of every source all copies: a_s = softmax(x) but alpha = softmax(S x), KL by hand."""
    slices, m = 4, 3
    v = [0.5, -1.0, 2.0]
    u = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.2, 0.4]]  # one slice pattern per source
    sources = torch.tensor([u_n * slices for u_n in u], dtype=torch.float64).view(3, 1, 1, slices * m)
    keys = routing_keys(sources, torch.ones(slices * m, dtype=torch.float64), EPS)
    kl = float(width_disagreement_kl(keys, torch.tensor(v * slices, dtype=torch.float64), slices))

    x = [sum(a * b for a, b in zip(v, u_n)) / math.sqrt(sum(e * e for e in u_n) / m + EPS) for u_n in u]
    a = [math.exp(xi) / sum(math.exp(xj) for xj in x) for xi in x]
    alpha = [math.exp(slices * xi) / sum(math.exp(slices * xj) for xj in x) for xi in x]
    expected = sum(ai * math.log(ai / al) for ai, al in zip(a, alpha))
    assert expected > 0.1
    assert kl == pytest.approx(expected, rel=1e-10)


def _preferring_sources_case(betas, m=3):
    """Source n < S is sqrt(D) e_(n*m) (RMS 1), source S is zero; slice s of q is beta_s e_(s*m)."""
    slices = len(betas)
    d = slices * m
    sources = torch.zeros(slices + 1, 2, 3, d, dtype=torch.float64)
    query = torch.zeros(d, dtype=torch.float64)
    for s, beta in enumerate(betas):
        sources[s, ..., s * m] = math.sqrt(d)
        query[s * m] = beta
    return sources, query, d


def _analytic_preference_kl(betas, d):
    """KL(a_s || alpha) by hand: slice s sees logit c_s on source s and 0 elsewhere; alpha sees c_n on source n."""
    r = 1 / math.sqrt(1 + EPS)  # rsqrt(mean square 1 + eps)
    c = [beta * math.sqrt(d) * r for beta in betas]
    n = len(betas) + 1
    full = c + [0.0]  # the zero source has a zero key: logit 0
    z_full = sum(math.exp(x) for x in full)
    alpha = [math.exp(x) / z_full for x in full]
    total = 0.0
    for s, cs in enumerate(c):
        z = math.exp(cs) + (n - 1)
        a = [(math.exp(cs) if k == s else 1.0) / z for k in range(n)]
        total += sum(ak * math.log(ak / al) for ak, al in zip(a, alpha))
    return total / len(c)


def test_slices_preferring_different_sources_give_the_analytic_kl():
    betas = [0.8, -0.4, 1.5, 0.2]
    sources, query, d = _preferring_sources_case(betas)
    expected = _analytic_preference_kl(betas, d)
    keys = routing_keys(sources, torch.ones(d, dtype=torch.float64), EPS)
    kl_BT = width_disagreement_kl(keys, query, len(betas))
    torch.testing.assert_close(kl_BT, torch.full((2, 3), expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    # The streaming accumulator (fp32 keys, two batches) reports the same number.
    stats = _stats_for_one_site(query.float(), torch.ones(d), heads=1, slices=len(betas))
    for half in (0, 1):
        stats.observe(0, sources[:, half : half + 1].float(), torch.tensor([half]))
    summary = stats.site_summary(0)["width_disagreement"]
    assert summary["trained"] == pytest.approx(expected, rel=1e-5)
    assert summary["excess"] == pytest.approx(summary["trained"] - summary["null"], abs=1e-12)
    assert stats.width_disagreement()["trained"] == pytest.approx(expected, rel=1e-5)


def test_slices_must_divide_the_width():
    with pytest.raises(ValueError, match="not divisible by --slices 5"):
        _stats_for_one_site(torch.ones(16), torch.ones(16), heads=1, slices=5)


# ---------------------------------------------------------------- matched-norm random null


@pytest.mark.parametrize("heads", [1, 4])
def test_null_queries_match_the_norm_per_head(heads):
    query_SD = torch.randn(3, 16, generator=torch.Generator().manual_seed(2)) * torch.tensor([0.1, 1.0, 5.0])[:, None]
    null_RSD = matched_norm_queries(query_SD, heads, 7, torch.Generator().manual_seed(0))
    assert null_RSD.shape == (7, 3, 16)
    norms = lambda x: x.view(*x.shape[:-1], heads, 16 // heads).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norms(null_RSD), norms(query_SD).expand(7, 3, heads), rtol=1e-6, atol=1e-7)
    again = matched_norm_queries(query_SD, heads, 7, torch.Generator().manual_seed(0))
    assert torch.equal(null_RSD, again)  # seeded: reproducible
    assert not torch.allclose(null_RSD[0], null_RSD[1])


def _numpy_width_kl(sources, query, norm, slices):
    """Independent implementation (numpy): mean over tokens and slices of KL(a_s || alpha)."""
    keys = sources / np.sqrt((sources**2).mean(-1, keepdims=True) + EPS) * norm
    d = sources.shape[-1]
    width = d // slices
    per_slice = np.stack([keys[..., s * width : (s + 1) * width] @ query[s * width : (s + 1) * width]
                          for s in range(slices)], axis=-1)  # [N, B, T, S]

    def log_softmax(x):
        x = x - x.max(0, keepdims=True)
        return x - np.log(np.exp(x).sum(0, keepdims=True))

    log_a, log_alpha = log_softmax(per_slice), log_softmax(per_slice.sum(-1, keepdims=True))
    return float((np.exp(log_a) * (log_a - log_alpha)).sum(0).mean())


def test_null_expectation_matches_a_direct_monte_carlo_estimate():
    rng = np.random.default_rng(7)
    slices, draws = 4, 3000
    sources = rng.standard_normal((5, 2, 4, 16)) * rng.uniform(0.5, 3.0, size=(5, 1, 1, 1))
    norm = rng.uniform(0.5, 1.5, size=16)
    query = rng.standard_normal(16) * 0.9
    keys = routing_keys(torch.tensor(sources), torch.tensor(norm), EPS)
    # The two implementations agree on the trained query ...
    trained = float(width_disagreement_kl(keys, torch.tensor(query), slices).mean())
    assert trained == pytest.approx(_numpy_width_kl(sources, query, norm, slices), rel=1e-9)
    # ... and the probe's null (its own generator) matches a Monte Carlo estimate with numpy's generator.
    null_RD = matched_norm_queries(torch.tensor(query)[None], 1, draws, torch.Generator().manual_seed(0))[:, 0]
    probe_values = np.array([float(width_disagreement_kl(keys, q, slices).mean()) for q in null_RD])
    z = rng.standard_normal((draws, 16))
    mc_queries = np.linalg.norm(query) * z / np.linalg.norm(z, axis=1, keepdims=True)
    mc_values = np.array([_numpy_width_kl(sources, q, norm, slices) for q in mc_queries])
    stderr = math.sqrt(probe_values.var() / draws + mc_values.var() / draws)
    assert abs(probe_values.mean() - mc_values.mean()) < 4 * stderr
    assert mc_values.mean() > 0.01  # a non-trivial expectation


# ---------------------------------------------------------------- collinearity


def test_collinearity_of_hand_made_sources():
    e = torch.eye(6, dtype=torch.float64)
    orthogonal = e[:4].view(4, 1, 1, 6)
    assert float(mean_pairwise_cosine(orthogonal)) == pytest.approx(0.0, abs=1e-15)
    copies = (e[0] * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)[:, None]).view(3, 1, 1, 6)
    assert float(mean_pairwise_cosine(copies)) == pytest.approx(1.0, abs=1e-12)  # scale-free
    mixed = torch.stack([e[0], 3 * e[0], e[1]]).view(3, 1, 1, 6)  # pairs: 1, 0, 0
    assert float(mean_pairwise_cosine(mixed)) == pytest.approx(1 / 3, abs=1e-12)
    angled = torch.stack([e[0], e[0] + e[1]]).view(2, 1, 1, 6)
    assert float(mean_pairwise_cosine(angled)) == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    with_zero = torch.stack([e[0], torch.zeros(6, dtype=torch.float64)]).view(2, 1, 1, 6)
    assert float(mean_pairwise_cosine(with_zero)) == 0.0  # a zero null source: 0, not NaN


def test_collinearity_is_averaged_over_tokens_at_the_collinearity_site():
    e = torch.eye(4)
    sources = torch.stack([torch.stack([e[0], e[0]]), torch.stack([e[0], e[1]])], dim=1)[:, :, None]  # [2, B=2, T=1, 4]
    stats = _stats_for_one_site(torch.ones(4), torch.ones(4), heads=1, slices=2)
    stats.observe(0, sources, torch.tensor([0, 1]))
    assert stats.collinearity()["mean_pairwise_cosine"] == pytest.approx(0.5)  # token 1: cos 1, token 2: cos 0


# ---------------------------------------------------------------- per-head deviation and split-half replication


def _two_head_case(beta=1.2, gamma=2.0):
    """H = 2, N = 2, D = 8. In a "forward" token head 0 prefers source 0 and head 1 source 1; "swapped" reverses."""
    u = torch.zeros(4)
    u[0] = gamma
    zero = torch.zeros(4)
    forward = torch.stack([torch.cat([u, zero]), torch.cat([zero, u])])  # [N, D]
    swapped = forward.flip(0)
    query = torch.cat([beta * torch.eye(4)[0], beta * torch.eye(4)[0]])
    c = beta * gamma / math.sqrt(gamma**2 / 8 + EPS)  # the winning logit
    p = 1 / (1 + math.exp(-c))
    return forward, swapped, query, p


def _observe_halves(first, second):
    forward, swapped, query, p = _two_head_case()
    pick = {"forward": forward, "swapped": swapped}
    sources_NBTD = torch.stack([pick[first], pick[second]], dim=1)[:, :, None].expand(2, 2, 3, 8)
    stats = _stats_for_one_site(query, torch.ones(8), heads=2)
    stats.observe(0, sources_NBTD, torch.tensor([0, 1]))
    return stats, p


def test_head_deviation_and_split_half_correlation_of_a_known_structure():
    stats, p = _observe_halves("forward", "swapped")
    expected_half0 = torch.tensor([[p - 0.5, 0.5 - p], [0.5 - p, p - 0.5]], dtype=torch.float64)  # [N, H]
    from mhar_lit.analysis.metrics import head_deviation

    torch.testing.assert_close(head_deviation(stats.mean_weights(0, half=0)), expected_half0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(head_deviation(stats.mean_weights(0, half=1)), -expected_half0, rtol=1e-6, atol=1e-7)
    assert stats.split_half_correlation([0]) == pytest.approx(-1.0, abs=1e-9)  # the halves disagree exactly
    summary = stats.head_deviation_summary()
    assert summary["max_abs"] == pytest.approx(0.0, abs=1e-7)  # pooled: both heads average to 1/2
    assert summary["split_half_r"] == pytest.approx(-1.0, abs=1e-9)

    stats, p = _observe_halves("forward", "forward")
    summary = stats.head_deviation_summary()
    assert summary["split_half_r"] == pytest.approx(1.0, abs=1e-9)  # identical halves replicate exactly
    assert summary["max_abs"] == pytest.approx(p - 0.5, rel=1e-6)
    assert summary["cross_head_r"] == pytest.approx(-1.0, abs=1e-9)  # the two heads mirror each other
    assert summary["cross_head_r_baseline"] == -1.0  # ... as any two heads must: deviations sum to 0
    assert 0.0 <= summary["null_max_abs"] <= 0.5


def test_pearson_by_hand():
    x, y = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([2.0, 1.0, 4.0, 3.0])
    assert pearson(x, y) == pytest.approx(0.6)  # cov 1.0 / var 1.25 (hand computation)
    assert pearson(x, torch.ones(4)) is None


# ---------------------------------------------------------------- capturing sources from a model


def _model(residual, size="tiny", query_scale=10.0, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ModelConfig.from_name(size, **overrides)
    model = DecoderLM(cfg, residual).eval()
    with torch.no_grad():
        residual.query.mul_(query_scale)  # non-uniform routing, so every statistic is non-trivial
    return model


def test_capture_sees_what_each_full_site_routes_and_leaves_the_forward_unchanged():
    model = _model(FullAttnRes(heads=4, random_query_init=True))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids)
    captured = capture_sources(model, ids)
    assert "route_sources" not in vars(model.residual)  # the wrapper is gone again
    assert sorted(captured) == list(range(5))
    assert [captured[s].shape[0] for s in range(5)] == [1, 2, 3, 4, 5]  # site s: s+1 sources, final: 2L+1
    embedding = model.embed_tokens(ids)
    for site in range(5):
        torch.testing.assert_close(captured[site][0], embedding)
    torch.testing.assert_close(captured[4][:4], captured[3])  # full mode: sources only accumulate
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference, rtol=0, atol=0)


@pytest.mark.parametrize("residual, size, counts", [
    (lambda: BlockAttnRes(heads=2, layers_per_block=2, random_query_init=True), "tiny-4l", [1, 2, 2, 2, 2, 3, 3, 3, 3]),
    (lambda: DeltaAttnRes(heads=2, layers_per_block=1), "tiny", [1, 2, 2, 3]),
])
def test_capture_works_for_block_and_delta(residual, size, counts):
    model = _model(residual(), size)
    captured = capture_sources(model, torch.randint(0, 256, (1, 5)))
    assert [captured[s].shape[0] for s in sorted(captured)] == counts


def test_a_strategy_without_routing_is_a_clear_error(tmp_path, capsys):
    model = DecoderLM(ModelConfig.from_name("tiny"), StandardResidual())
    with pytest.raises(ValueError, match="StandardResidual, which has no routing queries"):
        routed_residual(model)
    with pytest.raises(ValueError, match="no routing queries"):
        with observe_sources(model, lambda site, sources: None):
            pass
    ckpt = _save_checkpoint(model, tmp_path / "standard.ckpt")
    np.save(tmp_path / "ids.npy", np.arange(64) % 256)
    assert probe_main(["--ckpt", str(ckpt), "--tokens_file", str(tmp_path / "ids.npy"), "--out", str(tmp_path)]) == 2
    assert "no routing queries" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end


def _save_checkpoint(model, path):
    """The layout model_from_checkpoint reads (what LanguageModel.on_save_checkpoint writes)."""
    from mhar_lit.checkpoint import record_checksum

    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "mhar_lit": {"model_config": model.config.to_dict(), "residual": model.residual.to_config()}},
               path)
    record_checksum(path)  # as AtomicCheckpointIO does for every checkpoint `fit` writes
    return path


def _probe_twice(tmp_path, ckpt, extra):
    reports = []
    for run in ("a", "b"):
        out = tmp_path / f"out_{run}"
        assert probe_main(["--ckpt", str(ckpt), "--out", str(out), "--seed", "3", "--device", "cpu", *extra]) == 0
        reports.append((out / "report.json").read_text())
    assert reports[0] == reports[1]  # same seed, same tokens: the identical report, byte for byte
    return json.loads(reports[0]), tmp_path / "out_a"


def test_probe_end_to_end_single_head(tmp_path):
    model = _model(FullAttnRes(heads=1, random_query_init=True))
    ckpt = _save_checkpoint(model, tmp_path / "single.ckpt")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, size=3000))
    report, out = _probe_twice(tmp_path, ckpt, ["--tokens_file", str(tmp_path / "ids.npy"), "--tokens", "1024",
                                                "--seq_len", "64", "--batch_size", "5", "--null_draws", "3"])
    assert (report["tokens"], report["sequences"], report["seq_len"], report["seed"]) == (1024, 16, 64, 3)
    assert report["checkpoint"] == str(ckpt.resolve())
    assert [s["num_sources"] for s in report["sites"]] == [1, 2, 3, 4, 5]
    assert report["sites"][-1]["kind"] == "final"
    wd = report["width_disagreement"]
    assert wd["sites"] == [1, 2, 3, 4]  # N >= 2 only, final site included
    assert wd["trained"] > 0 and wd["null"] > 0 and len(wd["null_draws"]) == 3
    assert wd["excess"] == pytest.approx(wd["trained"] - wd["null"])
    per_site = [s["width_disagreement"]["trained"] for s in report["sites"][1:]]
    assert wd["trained"] == pytest.approx(sum(per_site) / 4)
    for site in report["sites"]:
        assert sum(w[0] for w in site["mean_weights"]) == pytest.approx(1.0)
    assert report["head_deviation"] is None
    assert -1.0 <= report["collinearity"]["mean_pairwise_cosine"] <= 1.0 and report["collinearity"]["site"] == 4
    assert {p.name for p in out.iterdir()} == {"report.json", "routing_weights.png", "width_disagreement.png"}

    # The per-site KL equals the metric applied directly to the captured sources (no streaming error).
    ids = torch.from_numpy(np.load(tmp_path / "ids.npy")[:1024]).view(16, 64)
    captured = capture_sources(model, ids)
    with torch.no_grad():
        keys = routing_keys(captured[4], model.residual.key_norm[4], EPS)
    direct = float(width_disagreement_kl(keys, model.residual.query[4].detach(), 4).double().mean())
    assert report["sites"][4]["width_disagreement"]["trained"] == pytest.approx(direct, rel=1e-5)


def test_probe_end_to_end_multi_head(tmp_path):
    model = _model(FullAttnRes(heads=4, random_query_init=True))
    ckpt = _save_checkpoint(model, tmp_path / "mhar.ckpt")
    torch.save(torch.randint(0, 256, (6, 48), generator=torch.Generator().manual_seed(1)), tmp_path / "ids.pt")
    report, out = _probe_twice(tmp_path, ckpt, ["--tokens_file", str(tmp_path / "ids.pt"), "--null_draws", "2"])
    assert (report["tokens"], report["sequences"], report["heads"]) == (288, 6, 4)
    assert report["width_disagreement"] is None
    hd = report["head_deviation"]
    deviations = [abs(x) for s in report["sites"][1:] for row in s["deviation"] for x in row]
    assert hd["max_abs"] == pytest.approx(max(deviations)) and hd["max_abs"] > 0.01
    assert -1.0 <= hd["split_half_r"] <= 1.0 and hd["null_max_abs"] > 0
    for site in report["sites"][1:]:
        assert all(abs(sum(row)) < 1e-9 for row in site["deviation"])  # deviations sum to 0 over heads
    assert {p.name for p in out.iterdir()} == {"report.json", "routing_weights.png", "head_deviation.png"}


def test_probe_reads_text_with_a_tokenizer(tmp_path):
    """--data: held-out documents of a .jsonl file, byte tokenizer (ids up to EOS = 256)."""
    from mhar_lit.data.sources import is_validation

    docs = [f"document {i}: " + "some text about routing over depth. " * 3 for i in range(200)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    held_out = [d for d in docs if is_validation(d, 0.2)]
    model = _model(FullAttnRes(heads=2, random_query_init=True), vocab_size=300)
    ckpt = _save_checkpoint(model, tmp_path / "m.ckpt")
    args = ["--ckpt", str(ckpt), "--data", str(tmp_path / "docs.jsonl"), "--tokenizer", "bytes",
            "--val_fraction", "0.2", "--tokens", "256", "--seq_len", "32", "--out", str(tmp_path / "out"),
            "--no_figures"]
    assert probe_main(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["tokens"] == 256 and report["sequences"] == 8
    assert report["token_source"] == {"kind": "documents", "path": str(tmp_path / "docs.jsonl"),
                                      "val_fraction": 0.2, "tokenizer": "bytes"}
    # The token stream is the held-out documents in file order, bytes then EOS (256), cut at --tokens.
    from mhar_lit.analysis.tokens import heldout_tokens
    from mhar_lit.data.tokenizer import load_tokenizer

    ids, _ = heldout_tokens(str(tmp_path / "docs.jsonl"), load_tokenizer("bytes"), 256, 32, 0.2)
    expected = [i for d in held_out for i in [*d.encode(), 256]][:256]
    assert 2 <= len(held_out) < len(docs) and ids.tolist() == expected


def test_probe_logs_artifacts_to_an_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("probe", artifact_location=str(tmp_path / "art"))).info.run_id
    model = _model(FullAttnRes(heads=1, random_query_init=True))
    ckpt = _save_checkpoint(model, tmp_path / "m.ckpt")
    np.save(tmp_path / "ids.npy", np.arange(256) % 256)
    assert probe_main(["--ckpt", str(ckpt), "--tokens_file", str(tmp_path / "ids.npy"), "--seq_len", "64",
                       "--out", str(tmp_path / "out"), "--tracking_uri", uri, "--run_id", run_id]) == 0
    names = {a.path for a in client.list_artifacts(run_id, "probe")}
    assert names == {"probe/report.json", "probe/routing_weights.png", "probe/width_disagreement.png"}
    metrics = client.get_run(run_id).data.metrics
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert metrics["probe/width_disagreement/excess"] == pytest.approx(report["width_disagreement"]["excess"])


def test_cli_dispatches_the_probe_tool(capsys):
    from mhar_lit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "--help"])
    assert exit_info.value.code == 0
    assert "--null_draws" in capsys.readouterr().out


# ---------------------------------------------------------------- bad input: a clear error, early, nothing written


def _good_checkpoint(tmp_path, heads=1):
    return _save_checkpoint(_model(FullAttnRes(heads=heads, random_query_init=True)), tmp_path / "good.ckpt")


@pytest.mark.parametrize("flag, value, message", [
    ("--batch_size", "0", "argument --batch_size/--batch-size: must be >= 1, got 0"),
    ("--tokens", "0", "argument --tokens: must be >= 1, got 0"),
    ("--tokens", "-5", "argument --tokens: must be >= 1, got -5"),
    ("--seq_len", "0", "argument --seq_len/--seq-len: must be >= 1, got 0"),
    ("--slices", "0", "argument --slices: must be >= 1, got 0"),
    ("--null_draws", "-1", "argument --null_draws/--null-draws: must be >= 1, got -1"),
    ("--batch_size", "two", "argument --batch_size/--batch-size: expected a whole number, got 'two'"),
    ("--seed", str(-2**63 - 1), f"argument --seed: must be in [-2**63, 2**64), got {-2**63 - 1}"),
    ("--seed", str(2**64), f"argument --seed: must be in [-2**63, 2**64), got {2**64}"),
    ("--val_fraction", "2", "argument --val_fraction/--val-fraction: must be in (0, 1], got 2"),
    ("--val_fraction", "0", "argument --val_fraction/--val-fraction: must be in (0, 1], got 0"),
    ("--val_fraction", "nan", "argument --val_fraction/--val-fraction: must be in (0, 1], got nan"),
])
def test_number_flags_are_checked_when_parsed(tmp_path, capsys, flag, value, message):
    # The checkpoint does not exist: an error about it would mean the flag got past argument parsing.
    with pytest.raises(SystemExit) as exit_info:
        probe_main(["--ckpt", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "out"), f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")
    assert not (tmp_path / "out").exists()


def test_probe_model_refuses_a_zero_batch_size():
    model = _model(FullAttnRes(heads=1, random_query_init=True))
    with pytest.raises(ValueError, match=r"^--batch_size must be >= 1, got 0$"):
        probe_model(model, torch.zeros(2, 8, dtype=torch.long), batch_size=0)


@pytest.mark.parametrize("extra, message", [
    (["--seq_len", "4096"], "--seq_len 4096 exceeds the model's max_position_embeddings 512"),
    (["--slices", "7"], "width 64 is not divisible by --slices 7"),
])
def test_flags_that_do_not_fit_the_model_fail_before_the_tokens_are_read(tmp_path, capsys, extra, message):
    ckpt = _good_checkpoint(tmp_path)
    args = ["--ckpt", str(ckpt), "--tokens_file", str(tmp_path / "missing.npy"), "--out", str(tmp_path / "out")]
    assert probe_main(args + extra) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("name, save, dtype", [
    ("rand.npy", lambda p: np.save(p, np.random.default_rng(0).random(4000)), "float64"),
    ("ids.pt", lambda p: torch.save(torch.arange(4000, dtype=torch.float32), p), "float32"),
    ("mask.npy", lambda p: np.save(p, np.ones(4000, dtype=bool)), "bool"),
])
def test_a_tokens_file_of_non_integers_is_refused(tmp_path, capsys, name, save, dtype):
    save(tmp_path / name)
    args = ["--ckpt", str(_good_checkpoint(tmp_path)), "--tokens_file", str(tmp_path / name),
            "--out", str(tmp_path / "out")]
    assert probe_main(args) == 2
    expected = f"error: {tmp_path / name}: token ids must be integers, found dtype {dtype}\n"
    assert capsys.readouterr().err == expected
    assert not (tmp_path / "out").exists()


def test_integer_tokens_files_of_any_width_still_load(tmp_path):
    from mhar_lit.analysis.tokens import load_token_file

    np.save(tmp_path / "u16.npy", np.arange(300, dtype=np.uint16))
    np.save(tmp_path / "be.npy", np.arange(300, dtype=">i4"))  # big-endian: torch.from_numpy alone refuses it
    torch.save(torch.arange(300, dtype=torch.int32), tmp_path / "i32.pt")
    for name in ("u16.npy", "be.npy", "i32.pt"):
        ids = load_token_file(str(tmp_path / name))
        assert ids.dtype == torch.int64 and ids.tolist() == list(range(300))


def _unwritable_dir(tmp_path):
    """A directory no file can be created in: chmod for a normal user; root writes anyway, so /proc."""
    if os.geteuid() == 0:
        return "/proc"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return str(locked)


def test_an_unusable_out_is_refused_before_the_model_is_loaded(tmp_path, capsys):
    # The checkpoint does not exist: the --out check must come first, so nothing is computed for nothing.
    (tmp_path / "notes.txt").write_text("keep me")
    missing = str(tmp_path / "none.ckpt")
    unwritable = os.path.join(_unwritable_dir(tmp_path), "out")
    cases = [("", "--out must not be empty"),
             (str(tmp_path / "notes.txt"), f"--out {tmp_path / 'notes.txt'} exists and is not a directory"),
             (str(tmp_path / "notes.txt" / "out"),
              f"--out {tmp_path / 'notes.txt' / 'out'} cannot be created: {tmp_path / 'notes.txt'} is not a directory"),
             (unwritable, f"--out {unwritable} is not writable: cannot create files in {os.path.dirname(unwritable)}")]
    for out, message in cases:
        assert probe_main(["--ckpt", missing, "--out", out]) == 2
        assert capsys.readouterr().err.startswith(f"error: {message}")
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert not os.path.exists(unwritable)


def _args_over_a_previous_report(tmp_path):
    """A probe run whose --out already holds a report.json of {"old": 1}."""
    np.save(tmp_path / "ids.npy", np.arange(256) % 256)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.json").write_text('{"old": 1}')
    return ["--ckpt", str(_good_checkpoint(tmp_path)), "--tokens_file", str(tmp_path / "ids.npy"),
            "--tokens", "256", "--seq_len", "64", "--out", str(tmp_path / "out"), "--no_figures"]


def test_a_report_that_cannot_be_serialised_leaves_the_previous_one_intact(tmp_path, capsys, monkeypatch):
    from mhar_lit.analysis import probe

    real = probe.build_report
    monkeypatch.setattr(probe, "build_report", lambda *a, **k: {**real(*a, **k), "broken": float("nan")})
    assert probe_main(_args_over_a_previous_report(tmp_path)) == 2
    assert capsys.readouterr().err == "error: Out of range float values are not JSON compliant: nan\n"
    assert (tmp_path / "out" / "report.json").read_text() == '{"old": 1}'


def test_a_report_write_that_fails_midway_leaves_the_previous_one_intact(tmp_path, capsys, monkeypatch):
    import builtins

    class FullDisk:  # writes half of the text, then fails as a full disk does
        def __init__(self, fh):
            self.fh = fh
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.fh.close()
        def write(self, text):
            self.fh.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, mode="r", *a, **k: FullDisk(real_open(f, mode, *a, **k))
                        if str(f).endswith("report.json.partial") else real_open(f, mode, *a, **k))
    assert probe_main(_args_over_a_previous_report(tmp_path)) == 2
    assert capsys.readouterr().err.endswith("report.json: No space left on device\n")
    assert (tmp_path / "out" / "report.json").read_text() == '{"old": 1}'
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json"]


def test_a_missing_or_deleted_mlflow_run_fails_before_anything_is_written(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    deleted_id = client.create_run(client.create_experiment("probe", artifact_location=str(tmp_path))).info.run_id
    client.delete_run(deleted_id)
    capsys.readouterr()  # MLflow's own log lines from creating the store
    np.save(tmp_path / "ids.npy", np.arange(256) % 256)
    base = ["--ckpt", str(_good_checkpoint(tmp_path)), "--tokens_file", str(tmp_path / "ids.npy"), "--seq_len", "64",
            "--out", str(tmp_path / "out")]
    assert probe_main(base + ["--tracking_uri", uri, "--run_id", "nosuchrun"]) == 2
    assert capsys.readouterr().err == (f"error: --run_id nosuchrun: cannot read this run at --tracking_uri "
                                       f"{uri}: Run with id=nosuchrun not found\n")
    assert probe_main(base + ["--tracking_uri", uri, "--run_id", deleted_id]) == 2
    assert capsys.readouterr().err == f"error: --run_id {deleted_id} at {uri} is deleted, not active\n"
    assert not (tmp_path / "out").exists()


def test_a_sqlite_store_that_does_not_exist_is_a_typo_not_a_new_store(tmp_path, capsys):
    typo = tmp_path / "mlfow.db"
    args = ["--ckpt", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "out"),
            "--tracking_uri", f"sqlite:///{typo}", "--run_id", "abc"]
    assert probe_main(args) == 2
    assert capsys.readouterr().err == (f"error: --tracking_uri sqlite:///{typo}: no MLflow store at {typo} "
                                       "(the probe logs into an existing run and does not create a store)\n")
    assert not typo.exists()


def test_an_unknown_device_is_refused_before_the_model_is_loaded(tmp_path, capsys):
    assert probe_main(["--ckpt", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "out"), "--device", "nodev"]) == 2
    assert capsys.readouterr().err.startswith("error: --device nodev is not usable: ")


UNREADABLE = "not a complete torch checkpoint (no readable zip archive: truncated, or another kind of file)"


def test_a_corrupt_checkpoint_is_unreadable_not_untrusted(tmp_path, capsys):
    good = _good_checkpoint(tmp_path).read_bytes()
    (tmp_path / "trunc.ckpt").write_bytes(good[: len(good) // 2])  # head -c: the zip's central directory is gone
    (tmp_path / "notes.ckpt").write_text("hi\n")
    (tmp_path / "noise.ckpt").write_bytes(np.random.default_rng(0).bytes(1000))
    for name in ("trunc.ckpt", "notes.ckpt", "noise.ckpt"):
        for trust in ([], ["--trust_checkpoint"]):
            path = tmp_path / name
            assert probe_main(["--ckpt", str(path), "--out", str(tmp_path / "out"), *trust]) == 2
            assert capsys.readouterr().err == f"error: cannot read checkpoint {path}: {UNREADABLE}\n"
    assert not (tmp_path / "out").exists()


def test_only_a_valid_checkpoint_with_pickled_objects_is_sent_to_trust_checkpoint(tmp_path, capsys):
    import argparse

    from mhar_lit.checkpoint import record_checksum

    model = _model(FullAttnRes(heads=1, random_query_init=True))
    ckpt = _save_checkpoint(model, tmp_path / "pickled.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["hyper_parameters"] = argparse.Namespace(lr=1e-3)  # a pickled object weights_only refuses
    torch.save(checkpoint, ckpt)
    record_checksum(ckpt)
    np.save(tmp_path / "ids.npy", np.arange(256) % 256)
    args = ["--ckpt", str(ckpt), "--tokens_file", str(tmp_path / "ids.npy"), "--seq_len", "64",
            "--out", str(tmp_path / "out"), "--no_figures"]
    assert probe_main(args) == 2
    assert capsys.readouterr().err == (f"error: {ckpt} contains pickled Python objects and was not loaded "
                                       "(weights_only); pass --trust_checkpoint (trust_pickle=True) only if you "
                                       "created this file\n")
    assert probe_main(args + ["--trust_checkpoint"]) == 0
    assert (tmp_path / "out" / "report.json").exists()
