"""Helpers shared by the data-layer tests (a unique module name: tests/ is not a package)."""

import json

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

EOS = 256  # the byte tokenizer's EOS id

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "Grüße aus Köln: ünïcödé text.",
    "short",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nprint(os.getcwd())\n",
    "λ calculus and ∀ quantifiers",
    "x = [i * i for i in range(10)]",
]


def byte_stream(docs):
    """The expected packed stream for the byte tokenizer: each document's UTF-8 bytes, then EOS."""
    out = []
    for d in docs:
        out.extend(d.encode("utf-8"))
        out.append(EOS)
    return out


def split_documents(tokens, eos=EOS):
    """Decode a byte-token stream back into its documents (the text between EOS tokens)."""
    docs, current = [], []
    for t in tokens:
        if t == eos:
            docs.append(bytes(current).decode("utf-8"))
            current = []
        else:
            current.append(t)
    assert not current, "stream does not end with EOS"
    return docs


def read_tokens(split_dir):
    """Every token of an optimized split in stored order (block_size=1, no shuffle: nothing dropped)."""
    from litdata import StreamingDataset, TokensLoader

    ds = StreamingDataset(split_dir, item_loader=TokensLoader(block_size=1), shuffle=False)
    return torch.cat([ds[i] for i in range(len(ds))]).tolist()


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def write_word_tokenizer(path, specials):
    """A tiny WordLevel tokenizer.json: ids 0..3 are words, then the given special tokens."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    for tok in specials:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(list(specials))
    tk.save(str(path))
    return path
