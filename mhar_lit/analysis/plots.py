"""Probe figures (matplotlib is imported inside each function: the probe runs without it, minus the PNGs)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def site_grid(per_site_NH: dict[int, Tensor]) -> tuple[list[int], Tensor]:
    """Stack {site: [N, H]} into [H, sites, max N], NaN where a site has fewer sources (blank cells)."""
    sites = sorted(per_site_NH)
    heads = per_site_NH[sites[0]].shape[1]
    width = max(per_site_NH[s].shape[0] for s in sites)
    grid_HSN = torch.full((heads, len(sites), width), float("nan"))
    for row, site in enumerate(sites):
        grid_HSN[:, row, : per_site_NH[site].shape[0]] = per_site_NH[site].T.float()
    return sites, grid_HSN


def heads_heatmap(per_site_NH: dict[int, Tensor], title: str, path: str, *, diverging: bool = False,
                  label: str = "mean routing weight") -> None:
    """One (sites x sources) panel per head, saved as a PNG. Diverging: a symmetric red-blue scale."""
    plt = _pyplot()
    sites, grid_HSN = site_grid(per_site_NH)
    heads = grid_HSN.shape[0]
    if diverging:
        limit = float(torch.nan_to_num(grid_HSN.abs(), nan=0.0).max()) or 1.0
        scale = {"vmin": -limit, "vmax": limit, "cmap": "RdBu_r"}
    else:
        scale = {"vmin": 0.0, "vmax": 1.0, "cmap": "viridis"}
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1.0, (0.25 * len(sites) + 2.5) * rows), squeeze=False)
    image = None
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(grid_HSN[h].numpy(), aspect="auto", interpolation="nearest", **scale)
        ax.set_title(f"head {h}" if heads > 1 else "single head", fontsize=9)
        ax.set_xlabel("source n")
        ax.set_ylabel("site")
        ax.set_yticks(range(len(sites)), [str(s) for s in sites], fontsize=6)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label=label)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def disagreement_plot(sites: list[int], trained: list[float], null: list[float], title: str, path: str,
                      null_label: Optional[str] = "matched-norm random query") -> None:
    """Per-site width-disagreement KL of the trained query against the random null."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.5))
    ax.plot(sites, trained, marker="o", label="trained query")
    ax.plot(sites, null, marker="x", linestyle="--", label=null_label)
    ax.set_xlabel("site")
    ax.set_ylabel("mean KL(a_s || alpha) [nats]")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
