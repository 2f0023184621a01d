"""The built-in methods (mhar_lit/residual/methods.py) are what the overlays, the composed paper recipes and the
README's methods table say."""

import os
from pathlib import Path

import pytest
import yaml

from mhar_lit.cli import build_cli
from mhar_lit.config import ModelConfig
from mhar_lit.residual import ResidualStrategy
from mhar_lit.residual.methods import METHODS, PAPER_SIZES, method, methods_table

REPO = Path(__file__).resolve().parents[1]


def test_every_overlay_is_one_registry_entry_with_the_same_residual():
    assert sorted(p.stem for p in (REPO / "configs/methods").glob("*.yaml")) == sorted(m.name for m in METHODS)
    for m in METHODS:
        overlay = yaml.safe_load((REPO / m.overlay).read_text())
        assert overlay == {"model": {"residual": {"class_path": m.class_path,
                                                  **({"init_args": m.init_args} if m.init_args else {})}}}, m.name
    assert sorted(p.stem for p in (REPO / "configs/paper").glob("*.yaml")) == sorted(PAPER_SIZES)


def test_the_readme_methods_table_is_the_registry():
    assert methods_table() in (REPO / "README.md").read_text()


def test_built_in_methods_have_distinct_labels():
    labels = [ResidualStrategy.from_config(m.residual_config()).method_label() for m in METHODS]
    assert len(set(labels)) == len(labels), labels
    assert method("mhar").init_args == {"heads": 8}
    with pytest.raises(KeyError, match="no built-in method 'nope'"):
        method("nope")


def _resolved(capsys, *configs) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        build_cli([*(a for c in configs for a in ("--config", str(REPO / c))), "--print_config"], run=False)
    assert exit_info.value.code in (None, 0)
    resolved = yaml.safe_load(capsys.readouterr().out)
    resolved["trainer"].pop("plugins", None)  # printed with the plugin object's address
    return resolved


@pytest.mark.parametrize("size", PAPER_SIZES)
def test_every_method_composes_with_the_paper_recipe_of_every_size(size, capsys):
    """`fit --config configs/paper/SIZE.yaml --config configs/methods/M.yaml` parses with the real CLI; the result
    is the base with the method's residual, which binds to the size's model (block tiling included)."""
    base = f"configs/paper/{size}.yaml"
    alone = _resolved(capsys, base)
    for m in METHODS:
        composed = _resolved(capsys, base, m.overlay)
        residual = composed["model"].pop("residual")
        assert residual["class_path"] == m.class_path, m.name
        assert {k: residual.get("init_args", {})[k] for k in m.init_args} == m.init_args, m.name
        alone["model"].pop("residual", None)
        assert composed == alone, m.name  # the overlay changes the method only
        strategy = ResidualStrategy.from_config(residual)
        strategy.bind(ModelConfig.from_name(size, **(composed["model"].get("model_overrides") or {})))


def test_the_block_overlay_gives_the_papers_partitions():
    """At most 8 equal blocks: 6 x 2 layers at 100M, 8 x 3 at 350M, 6 x 6 at 1B (where the paper's ceil rule would
    leave a 1-layer last block, docs/method.md J6)."""
    block = ResidualStrategy.from_config(method("block-mhar").residual_config())
    depths = {size: ModelConfig.from_name(size).num_layers for size in PAPER_SIZES}
    layers = {size: block.resolve_block_layers(depth) for size, depth in depths.items()}
    assert layers == {"100M": 2, "350M": 3, "1B": 6}
    with pytest.raises(RuntimeError, match="routes once bound to a model"):
        block.router  # the block size is unknown before the depth is


def test_readme_and_docs_name_no_removed_recipe():
    """Every `configs/...yaml` path in the README and docs exists (the per-method paper files were replaced)."""
    import re

    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = set()
    for path in texts:
        if path.name == "LOG.md":  # dated entries keep the paths of their day
            continue
        for found in re.findall(r"configs/[\w./-]+\.yaml", path.read_text()):
            if not (REPO / found).is_file():
                missing.add(f"{os.path.relpath(path, REPO)}: {found}")
    assert not missing, sorted(missing)
