"""Tokenizers for pre-tokenizing text: raw bytes, a Hugging Face `tokenizer.json`, or a local BPE.

`load_tokenizer(spec)` accepts
- `"bytes"`: byte-level, ids 0..255 are the UTF-8 bytes and 256 is EOS (vocab 257). No files.
- a path to a Hugging Face `tokenizer.json` (for example Qwen3's). EOS defaults to `<|im_end|>` when
  the vocabulary has it (docs/method.md J9: the Qwen3 reproduction appends id 151645 = `<|im_end|>`), else
  `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` (EOS_CANDIDATES); pass `eos` (a token string or an id)
  to override.
- `"bpe:<vocab>"`: a byte-level BPE of that vocabulary size trained locally with `tokenizers` on
  the given texts and cached as a `tokenizer.json` under `cache_dir` (EOS is `<|endoftext|>`).

Every tokenizer exposes `vocab_size`, `eos_id`, `fingerprint` (it keys the token cache),
`encode_batch(texts, add_special_tokens=False) -> list of int arrays` and pickles cheaply (by
path), because litdata sends it to its worker processes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

# Candidate EOS tokens for Hugging Face tokenizers, in order of preference (see module docstring): the one
# default of every reader (training, generate, export, the lm-eval adapter). Llama's and Gemma's names come
# after Qwen's, so a vocabulary holding Qwen's tokens keeps the id it trained with.
EOS_CANDIDATES = ("<|im_end|>", "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BPE_EOS = "<|endoftext|>"


def _utf8(text: str) -> bytes:
    # "replace" only matters for lone surrogates (which json.loads can produce): a
    # strict encode would crash a whole preparation run on one odd document.
    return text.encode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus EOS = 256. Needs no files, never unknown tokens."""

    eos_id = 256
    vocab_size = 257
    fingerprint = "bytes-v1"
    name = "bytes"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(_utf8(t), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a `tokenizer.json` file."""

    def __init__(self, path: str | os.PathLike, eos: str | int | None = None, name: str | None = None):
        self.path = Path(path)
        self._eos_arg = eos
        self.name = name or str(self.path)  # what the user asked for (a trained BPE's file name holds a hash)
        self._load()

    def _load(self) -> None:
        if not self.path.is_file():
            raise FileNotFoundError(
                f"tokenizer file not found: {self.path} (expected 'bytes', 'bpe:<vocab>' "
                "or the path of a Hugging Face tokenizer.json)"
            )
        self._tk = read_tokenizer_json(self.path)
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._resolve_eos(self._eos_arg)
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self.fingerprint = f"hf-{digest}-eos{self.eos_id}"

    def _resolve_eos(self, eos: str | int | None) -> int:
        if isinstance(eos, int):
            if not 0 <= eos < self.vocab_size:
                raise ValueError(f"eos id {eos} is outside the vocabulary of {self.path} (size {self.vocab_size})")
            return eos
        candidates = (eos,) if eos is not None else EOS_CANDIDATES
        for token in candidates:
            token_id = self._tk.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(f"tokenizer {self.path} has none of the EOS tokens {list(candidates)}; pass eos=<token or id>")

    # Pickle by path: the Rust tokenizer is rebuilt in each litdata worker process.
    def __getstate__(self) -> dict:
        return {"path": self.path, "_eos_arg": self._eos_arg, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        try:
            encodings = self._tk.encode_batch(texts, add_special_tokens=False)
        except (UnicodeEncodeError, TypeError):
            # Lone surrogates cannot cross into Rust; replace them and retry once.
            texts = [_utf8(t).decode("utf-8") for t in texts]
            encodings = self._tk.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def read_tokenizer_json(path: str | Path):
    """A `tokenizers.Tokenizer` from a Hugging Face tokenizer.json; an unreadable file is a ValueError naming it
    (the tokenizers library raises a bare Exception naming neither the file nor the expected format)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:
        raise ValueError(f"cannot read tokenizer {path}: {err} (expected a Hugging Face tokenizer.json)") from None


def _parse_bpe_vocab(spec: str) -> int:
    try:
        vocab = int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"bad tokenizer spec {spec!r}: expected 'bpe:<vocab size>', e.g. 'bpe:4096'") from None
    if vocab < 257 + 1:
        raise ValueError(f"bpe vocab size must exceed the 256-byte alphabet plus EOS, got {vocab}")
    return vocab


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path) -> Path:
    """Train a byte-level BPE on `texts` and write its tokenizer.json atomically to `out_path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknowns
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    tk.save(str(tmp))
    os.replace(tmp, out_path)  # atomic: readers never see a half-written file
    return out_path


def cached_bpe_path(spec: str, cache_dir: str | os.PathLike | None) -> Path:
    """The tokenizer.json that a `bpe:<vocab>` run trained and cached (`cache_dir/tokenizers/bpe-<vocab>-<key>.json`).
    The key hashes the training corpus, which a checkpoint does not record, so the file must be the only one of
    that vocabulary in the folder; otherwise a FileNotFoundError lists what was found."""
    vocab = _parse_bpe_vocab(spec)
    folder = Path(cache_dir or "data_cache") / "tokenizers"
    found = sorted(folder.glob(f"bpe-{vocab}-*.json"))
    if len(found) != 1:
        what = "none" if not found else ", ".join(str(f) for f in found)
        raise FileNotFoundError(f"tokenizer {spec!r} was trained for its run: expected one cached "
                                f"bpe-{vocab}-*.json in {folder}, found {what}")
    return found[0]


def load_tokenizer(
    spec: str,
    eos: str | int | None = None,
    cache_dir: str | os.PathLike | None = None,
    bpe_texts: Callable[[], Iterable[str]] | None = None,
    bpe_texts_key: str = "",
) -> Tokenizer:
    """Build the tokenizer named by `spec` (see the module docstring).

    For `"bpe:<vocab>"`, `bpe_texts()` yields the training texts and `bpe_texts_key` identifies
    them; the trained file is cached at `cache_dir/tokenizers/bpe-<vocab>-<hash>.json` and reused.
    """
    spec = str(spec)
    if spec == "bytes":
        if eos is not None:
            raise ValueError("the 'bytes' tokenizer has a fixed EOS id (256); do not pass eos")
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        vocab = _parse_bpe_vocab(spec)
        if cache_dir is None or bpe_texts is None:
            raise ValueError("a 'bpe:<vocab>' tokenizer needs cache_dir and bpe_texts to train on")
        key = hashlib.sha256(f"{vocab}|{bpe_texts_key}".encode()).hexdigest()[:16]
        path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab}-{key}.json"
        if not path.is_file():
            train_bpe(bpe_texts(), vocab, path)
        return HFTokenizer(path, eos=BPE_EOS if eos is None else eos, name=spec)
    return HFTokenizer(spec, eos=eos)
