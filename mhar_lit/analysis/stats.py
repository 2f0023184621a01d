"""Streaming accumulation of the probe statistics over batches (docs/method.md G).

Sources are never kept: each (site, batch) is reduced on the spot to running float64 sums, so the probe
runs over ~100K tokens of a 1B model (73 sources of width 1280 at the final site) in bounded memory.

Shape legend: N sources, B sequences, T positions, D width, H routing heads, R null draws, S sites.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from mhar_lit.analysis.metrics import (
    head_deviation,
    head_weights,
    mean_pairwise_cosine,
    pearson,
    routing_keys,
    width_disagreement_kl,
)

HALVES = 2  # split-half replication: disjoint first / second half of the sequences
FIRST_SITES = 10  # the paper quotes max |Delta| over the first 10 sites


@dataclass
class _SiteSums:
    num_sources: int
    weight_sum_2NH: Tensor  # token sums of alpha^(h)_n, per half
    tokens_2: Tensor  # token counts per half
    kl_sum: float = 0.0  # width-disagreement, trained query (single-head models)
    null_kl_sum_R: Optional[Tensor] = None  # the same per null draw
    null_weight_sum_RNH: Optional[Tensor] = None  # alpha under each null query (multi-head models)
    cosine_sum: float = 0.0  # collinearity (collinearity site only)


class RoutingStats:
    """Running sums of every probe statistic, fed one (site, sources) at a time by the capture hook.

    Args:
        query_SD, key_norm_SD: the strategy's per-site parameters.
        heads: routing heads H of the model. heads == 1 enables the S-slice width-disagreement,
            heads > 1 the per-head deviation and its split-half replication.
        slices: S, the number of contiguous query slices for the width-disagreement.
        null_queries_RSD: matched-norm random queries, one set of sites per draw.
        collinearity_site: the site whose sources give the collinearity (the final site: all sources).
    """

    def __init__(self, query_SD: Tensor, key_norm_SD: Tensor, heads: int, slices: int, null_queries_RSD: Tensor,
                 collinearity_site: int, eps: float = 1e-6) -> None:
        width = query_SD.shape[-1]
        if heads == 1 and width % slices != 0:
            raise ValueError(f"width {width} is not divisible by --slices {slices}")
        self.query_SD, self.key_norm_SD = query_SD.detach(), key_norm_SD.detach()
        self.null_RSD = null_queries_RSD.detach()
        self.heads, self.slices, self.eps = heads, slices, eps
        self.collinearity_site = collinearity_site
        self.sites: dict[int, _SiteSums] = {}

    @property
    def draws(self) -> int:
        return self.null_RSD.shape[0]

    def _sums_for(self, site: int, num_sources: int) -> _SiteSums:
        sums = self.sites.get(site)
        if sums is None:
            sums = _SiteSums(num_sources, torch.zeros(HALVES, num_sources, self.heads, dtype=torch.float64),
                             torch.zeros(HALVES, dtype=torch.float64))
            if num_sources >= 2 and self.heads == 1:
                sums.null_kl_sum_R = torch.zeros(self.draws, dtype=torch.float64)
            if num_sources >= 2 and self.heads > 1:
                sums.null_weight_sum_RNH = torch.zeros(self.draws, num_sources, self.heads, dtype=torch.float64)
            self.sites[site] = sums
        elif sums.num_sources != num_sources:
            raise RuntimeError(f"site {site} routed over {num_sources} sources, earlier over {sums.num_sources}")
        return sums

    @torch.no_grad()
    def observe(self, site: int, sources_NBTD: Tensor, half_B: Tensor) -> None:
        """Add one batch of one site. half_B [B] (0 or 1) says which split half each sequence belongs to."""
        n, b, t, _ = sources_NBTD.shape
        sums = self._sums_for(site, n)
        device = sources_NBTD.device
        keys_NBTD = routing_keys(sources_NBTD, self.key_norm_SD[site].to(device), self.eps)
        weights_NBTH = head_weights(keys_NBTD, self.query_SD[site].to(device), self.heads)
        per_sequence_NBH = weights_NBTH.sum(2).double().cpu()
        half = half_B.to("cpu", torch.long)
        sums.weight_sum_2NH.index_add_(0, half, per_sequence_NBH.permute(1, 0, 2))
        sums.tokens_2.index_add_(0, half, torch.full((b,), float(t), dtype=torch.float64))
        if n >= 2 and self.heads == 1:
            self._observe_width_disagreement(sums, site, keys_NBTD)
        if n >= 2 and self.heads > 1:
            for r in range(self.draws):
                null_w = head_weights(keys_NBTD, self.null_RSD[r, site].to(device), self.heads)
                sums.null_weight_sum_RNH[r] += null_w.sum((1, 2)).double().cpu()
        if site == self.collinearity_site and n >= 2:
            sums.cosine_sum += float(mean_pairwise_cosine(sources_NBTD).double().sum())

    def _observe_width_disagreement(self, sums: _SiteSums, site: int, keys_NBTD: Tensor) -> None:
        device = keys_NBTD.device
        kl_BT = width_disagreement_kl(keys_NBTD, self.query_SD[site].to(device), self.slices)
        sums.kl_sum += float(kl_BT.double().sum())
        for r in range(self.draws):
            kl = width_disagreement_kl(keys_NBTD, self.null_RSD[r, site].to(device), self.slices)
            sums.null_kl_sum_R[r] += kl.double().sum().cpu()

    # ------------------------------------------------------------------ summaries
    def mean_weights(self, site: int, half: Optional[int] = None) -> Tensor:
        """Token-averaged routing weights wbar [N, H] over all tokens or one split half."""
        sums = self.sites[site]
        if half is None:
            return sums.weight_sum_2NH.sum(0) / sums.tokens_2.sum()
        return sums.weight_sum_2NH[half] / sums.tokens_2[half]

    def tokens(self, site: int) -> float:
        return float(self.sites[site].tokens_2.sum())

    def multi_source_sites(self) -> list[int]:
        return [s for s in sorted(self.sites) if self.sites[s].num_sources >= 2]

    def site_summary(self, site: int) -> dict[str, Any]:
        sums, tokens = self.sites[site], self.tokens(site)
        weights_NH = self.mean_weights(site)
        out: dict[str, Any] = {
            "num_sources": sums.num_sources,
            "mean_weights": weights_NH.tolist(),  # [N][H]
            "entropy": (-(weights_NH.clamp_min(1e-12).log() * weights_NH).sum(0)).tolist(),  # [H], nats
        }
        if sums.null_kl_sum_R is not None:
            trained, null_R = sums.kl_sum / tokens, (sums.null_kl_sum_R / tokens)
            out["width_disagreement"] = {"trained": trained, "null": float(null_R.mean()),
                                         "excess": trained - float(null_R.mean()), "null_draws": null_R.tolist()}
        if sums.null_weight_sum_RNH is not None:
            deviation_NH = head_deviation(weights_NH)
            out["deviation"] = deviation_NH.tolist()  # [N][H]
            out["max_abs_deviation"] = float(deviation_NH.abs().max())
            out["null_max_abs_deviation"] = float(self._null_max_abs_R([site]).mean())
        if site == self.collinearity_site and sums.num_sources >= 2:
            out["mean_pairwise_cosine"] = sums.cosine_sum / tokens
        return out

    def _null_max_abs_R(self, sites: list[int]) -> Tensor:
        """max |Delta| over the given sites under each null draw [R]."""
        per_site_RS = [head_deviation(self.sites[s].null_weight_sum_RNH / self.tokens(s)).abs().amax((1, 2))
                       for s in sites]
        return torch.stack(per_site_RS, dim=1).amax(1)

    def width_disagreement(self) -> Optional[dict[str, Any]]:
        """Mean over sites with N >= 2 of the slice KL (trained, null, excess); None for multi-head models."""
        sites = [s for s in self.multi_source_sites() if self.sites[s].null_kl_sum_R is not None]
        if self.heads != 1 or not sites:
            return None
        trained = sum(self.sites[s].kl_sum / self.tokens(s) for s in sites) / len(sites)
        null_R = torch.stack([self.sites[s].null_kl_sum_R / self.tokens(s) for s in sites]).mean(0)
        return {"sites": sites, "slices": self.slices, "trained": trained, "null": float(null_R.mean()),
                "excess": trained - float(null_R.mean()), "null_draws": null_R.tolist()}

    def head_deviation_summary(self) -> Optional[dict[str, Any]]:
        """max |Delta| (all sites and the first 10), its null, split-half and cross-head correlations."""
        sites = self.multi_source_sites()
        if self.heads == 1 or not sites:
            return None
        first = [s for s in sites if s < FIRST_SITES]
        deviations = [head_deviation(self.mean_weights(s)) for s in sites]
        return {
            "sites": sites,
            "max_abs": max(float(d.abs().max()) for d in deviations),
            "max_abs_first_10_sites": max(float(d.abs().max()) for s, d in zip(sites, deviations) if s < FIRST_SITES)
            if first else None,
            "null_max_abs": float(self._null_max_abs_R(sites).mean()),
            "null_max_abs_first_10_sites": float(self._null_max_abs_R(first).mean()) if first else None,
            "split_half_r": self.split_half_correlation(sites),
            "cross_head_r": self.cross_head_correlation(sites),
            # Deviations sum to zero over heads, so unrelated heads correlate at -1/(H-1), not 0 (H = 2: -1).
            "cross_head_r_baseline": -1.0 / (self.heads - 1),
        }

    def split_half_correlation(self, sites: list[int]) -> Optional[float]:
        """Pearson r between the deviations of the two halves over all (site, head, source) entries."""
        if any(float(self.sites[s].tokens_2.min()) == 0.0 for s in sites):
            return None  # one half is empty (a single sequence): nothing to replicate against
        halves = [torch.cat([head_deviation(self.mean_weights(s, h)).flatten() for s in sites]) for h in range(HALVES)]
        return pearson(halves[0], halves[1])

    def cross_head_correlation(self, sites: list[int]) -> Optional[float]:
        """Mean over head pairs of Pearson r between their deviation profiles over (site, source)."""
        profiles_HX = torch.cat([head_deviation(self.mean_weights(s)) for s in sites], dim=0).T
        values = [pearson(profiles_HX[i], profiles_HX[j])
                  for i in range(self.heads) for j in range(i + 1, self.heads)]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def collinearity(self) -> Optional[dict[str, Any]]:
        sums = self.sites.get(self.collinearity_site)
        if sums is None or sums.num_sources < 2:
            return None
        return {"site": self.collinearity_site, "num_sources": sums.num_sources,
                "mean_pairwise_cosine": sums.cosine_sum / self.tokens(self.collinearity_site)}
