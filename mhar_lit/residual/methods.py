"""The built-in methods: one entry each, read by the tests (every overlay and every composed paper recipe), the
method overlays in configs/methods/ (checked against it) and the README's methods table (rendered from it).

A method is a strategy with its options, selected by an overlay file layered after a base config:

    python -m mhar_lit fit --config configs/paper/100M.yaml --config configs/methods/mhar.yaml

To add one: a `Method` here and its overlay `configs/methods/<name>.yaml` with the same class path and options
(docs/extending.md); the tests then parse it on every paper size and the README table must show its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Method:
    name: str  # the overlay's file name without .yaml, and the method's name in scripts (benchmarks/replicate.sh)
    title: str  # how the README's table names it
    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    @property
    def overlay(self) -> str:
        """The overlay file, relative to the repository root."""
        return f"configs/methods/{self.name}.yaml"

    def residual_config(self) -> dict[str, Any]:
        """model.residual as the overlay gives it ({class_path, init_args}), for ResidualStrategy.from_config."""
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}

    def table_row(self) -> str:
        """The method's row of the README's methods table."""
        options = ", ".join(f"`{k}: {str(v).lower() if isinstance(v, bool) else v}`" for k, v in self.init_args.items())
        strategy = f"`{self.class_path}`" + (f" with {options}" if options else "")
        return f"| {self.title} | {strategy} | `{self.overlay}` |"


METHODS: tuple[Method, ...] = (
    Method("baseline", "standard pre-norm residual (baseline)", "mhar_lit.residual.StandardResidual"),
    Method("hc", "hyper-connections, n = 4, dynamic (Zhu et al.)", "mhar_lit.residual.HyperConnections",
           {"streams": 4, "dynamic": True}),
    Method("single-head", "single-head attention residuals (Kimi)", "mhar_lit.residual.FullAttnRes", {"heads": 1}),
    Method("mhar", "MHAR, H = 8", "mhar_lit.residual.FullAttnRes", {"heads": 8}),
    Method("block-mhar", "block MHAR, H = 8, at most 8 equal blocks", "mhar_lit.residual.BlockAttnRes",
           {"heads": 8, "num_blocks": 8}),
)

# The sizes of the paper's recipes: configs/paper/<size>.yaml, each composed with every method above.
PAPER_SIZES = ("100M", "350M", "1B")


def method(name: str) -> Method:
    """The built-in method called `name`; a clear error naming the others."""
    for candidate in METHODS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no built-in method {name!r}; the methods are {[m.name for m in METHODS]}")


def methods_table() -> str:
    """The README's methods table (header and one row per built-in method)."""
    header = ["| method | strategy (`model.residual`) | overlay |", "|---|---|---|"]
    return "\n".join(header + [m.table_row() for m in METHODS])
