"""Fixtures for the data-layer tests."""

import pytest
from datatest_helpers import DOCS


@pytest.fixture
def txt_corpus(tmp_path):
    """One document per .txt file, names sorted in DOCS order."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i, doc in enumerate(DOCS):
        (root / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return root
