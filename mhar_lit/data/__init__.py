"""Data layer: embedded corpus, tokenizers, cached pre-tokenization and the Lightning DataModule.

Names are resolved lazily so `import mhar_lit.data` does not pull in Lightning, litdata or pyarrow.
"""

import importlib

_EXPORTS = {
    "TokenDataModule": "mhar_lit.data.datamodule",
    "collate_tokens": "mhar_lit.data.datamodule",
    "prepare": "mhar_lit.data.prepare",
    "PreparedData": "mhar_lit.data.prepare",
    "load_tokenizer": "mhar_lit.data.tokenizer",
    "ByteTokenizer": "mhar_lit.data.tokenizer",
    "HFTokenizer": "mhar_lit.data.tokenizer",
    "stdlib_corpus_files": "mhar_lit.data.corpus",
    "InputError": "mhar_lit.data.sources",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mhar_lit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
