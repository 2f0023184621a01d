"""`TokenDataModule`: pre-tokenized, packed token blocks streamed with litdata.

A batch is an int64 tensor `tokens_BT1` of shape [batch_size, seq_len + 1]: consecutive tokens of
the packed stream (documents + EOS, no padding). The model uses `tokens_BT1[:, :-1]` as inputs and
`tokens_BT1[:, 1:]` as targets.

Lifecycle (Lightning calls these in order):
- `__init__` only loads the tokenizer, so `vocab_size` and `eos_id` are known at once (LanguageModel.setup
  checks that the model's vocab_size covers it, naming model.model_overrides.vocab_size) and nothing
  distributed-sensitive happens yet.
- `prepare_data` (local rank 0 of each node) tokenizes the inputs into the cache, or reuses it after checking
  every chunk against the checksums recorded at preparation (once per file per process).
- `setup` builds the `StreamingDataset`s on every rank, after the process group exists, so litdata
  splits chunks across ranks (a dataset built earlier would give every rank the whole epoch).

Training batches are shuffled with `seed` (litdata reshuffles each epoch) and the train loader is a
`StreamingDataLoader`, whose state Lightning saves in checkpoints and restores on `fit(ckpt_path=...)`,
so a resumed run continues with the next unseen batch. Validation is never shuffled: every
evaluation sees the same batches in the same order (cap them with Trainer `limit_val_batches`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch

from mhar_lit.data.corpus import DEFAULT_MAX_CORPUS_BYTES
from mhar_lit.data.prepare import DEFAULT_CHUNK_TOKENS, PreparedData, _input_files, input_digests, prepare
from mhar_lit.data.sources import InputError, find_optimized, is_valid_utf8, is_validation, iter_documents
from mhar_lit.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


def collate_tokens(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Stack int32 token blocks into an int64 [B, T+1] batch (embedding and loss want int64)."""
    return torch.stack(blocks).long()


class TokenDataModule(L.LightningDataModule):
    """Packed next-token-prediction blocks from local text, parquet, jsonl, litdata or the stdlib corpus.

    Args:
        data: input paths, directories or globs (.txt/.md/.py/.jsonl/.parquet); an optimized
            litdata dataset (a directory with index.json, or train/ + val/, or an s3:// URI);
            or None for the embedded Python-standard-library corpus.
        tokenizer: "bytes", "bpe:<vocab>" (trained locally on the training split, cached) or the
            path of a Hugging Face tokenizer.json (for example Qwen3's).
        eos: EOS token (string or id) for a tokenizer.json; default `<|im_end|>`, else `<|endoftext|>`.
        seq_len: tokens per training sequence T; each sample holds T + 1 tokens.
        batch_size / val_batch_size: per-device batch sizes (val defaults to batch_size).
        num_workers: DataLoader worker processes per device.
        cache_dir: where prepared token chunks (and trained BPE tokenizers) are cached.
        val_fraction: fraction of documents held out for validation, chosen by content hash.
        text_field: JSON field / parquet column holding the text.
        max_corpus_bytes: byte cap of the embedded corpus (only used when data is None).
        seed: shuffle seed of the training stream; None (default) follows the run's seed_everything, so
            runs with the same seed see the same data order and different seeds differ in order too.
        shuffle: shuffle the training stream.
        prep_workers: processes used to tokenize (default: 1 below 8 MB of input, else min(8, CPUs)); the
            prepared tokens are the same for any value.
        chunk_tokens: tokens per litdata chunk file.
        strict: raise on a non-UTF-8 input file instead of skipping it.
    """

    def __init__(
        self,
        data: list[str] | str | None = None,
        tokenizer: str = "bytes",
        eos: str | int | None = None,
        seq_len: int = 1024,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 2,
        cache_dir: str = "data_cache",
        val_fraction: float = 0.005,
        text_field: str = "text",
        max_corpus_bytes: int | None = DEFAULT_MAX_CORPUS_BYTES,
        seed: int | None = None,
        shuffle: bool = True,
        prep_workers: int | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        strict: bool = False,
    ):
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if val_batch_size is not None and val_batch_size < 1:  # 0 would silently become batch_size
            raise ValueError(f"val_batch_size must be positive (or null: batch_size), got {val_batch_size}")
        self.save_hyperparameters()
        self.data = data
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.val_fraction = val_fraction
        self.text_field = text_field
        self.max_corpus_bytes = max_corpus_bytes
        self.seed = seed
        self.shuffle = shuffle
        self.prep_workers = prep_workers
        self.chunk_tokens = chunk_tokens
        self.strict = strict
        self.tokenizer: Tokenizer = self._load_tokenizer(tokenizer, eos)
        self.train_dataset = None
        self.val_dataset = None

    # ------------------------------------------------------------ tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def _load_tokenizer(self, spec: str, eos: str | int | None) -> Tokenizer:
        if not str(spec).startswith("bpe:"):
            return load_tokenizer(spec, eos=eos)
        texts, key = self._bpe_training_texts()
        return load_tokenizer(spec, eos=eos, cache_dir=self.cache_dir, bpe_texts=texts, bpe_texts_key=key)

    def _bpe_training_texts(self):
        """The training-split documents (never validation ones) and a key naming them, for BPE training."""
        specs = [self.data] if isinstance(self.data, str) else self.data
        if specs is not None and any(find_optimized(str(d)) for d in specs):
            raise InputError("a 'bpe:<vocab>' tokenizer cannot be trained from an already tokenized dataset")
        files = _input_files(specs, self.max_corpus_bytes)
        # Content, not mtime: touching an unchanged corpus must not retrain the tokenizer (and re-tokenize).
        payload = [input_digests(files, self.cache_dir), self.text_field, self.val_fraction]
        key = hashlib.sha256(json.dumps(payload).encode()).hexdigest()

        def texts():
            for f in files:
                if f.suffix != ".parquet" and not is_valid_utf8(f.path):
                    continue
                yield from (d for d in iter_documents(f.path, self.text_field) if not is_validation(d, self.val_fraction))

        return texts, key

    # ------------------------------------------------------------ preparation

    def _prepare(self, build: bool) -> PreparedData:
        """build=True (prepare_data: local rank 0 of each node, before setup) also verifies a reused cache's chunk
        checksums; setup on every rank then finds the same files without reading them again."""
        return prepare(
            self.data,
            self.tokenizer,
            cache_dir=self.cache_dir,
            val_fraction=self.val_fraction,
            text_field=self.text_field,
            max_corpus_bytes=self.max_corpus_bytes,
            chunk_tokens=self.chunk_tokens,
            num_workers=self.prep_workers,
            strict=self.strict,
            build=build,
            verify=build,
        )

    def prepare_data(self) -> None:
        self._prepare(build=True)

    def setup(self, stage: str | None = None) -> None:
        from litdata import StreamingDataset, TokensLoader

        if self.train_dataset is not None:
            return  # setup runs once per stage; the datasets do not depend on it
        prepared = self._prepare(build=False)
        self._check_prebuilt(prepared)
        block = self.seq_len + 1
        self.train_dataset = StreamingDataset(
            prepared.train_dir,
            item_loader=TokensLoader(block_size=block),
            shuffle=self.shuffle,
            seed=self.shuffle_seed(),
            drop_last=True,
        )
        if prepared.val_dir is not None:
            self.val_dataset = StreamingDataset(
                prepared.val_dir, item_loader=TokensLoader(block_size=block), shuffle=False, drop_last=True
            )
        self._check_not_empty()

    # ------------------------------------------------------------ resume

    def _stream_settings(self) -> dict[str, Any]:
        """What the training stream's saved position depends on (litdata refuses a state of another stream
        without naming the setting that changed). num_workers is not among them: litdata resumes across a
        change of workers itself."""
        split = self.train_dataset.input_dir
        return {"seq_len": self.seq_len, "shuffle": self.shuffle, "seed": self.shuffle_seed(),
                "prepared training split": str(split.url or split.path)}

    def state_dict(self) -> dict[str, Any]:
        return {"stream_settings": self._stream_settings()} if self.train_dataset is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resuming a fit restores the training stream's position: refuse other stream settings, naming them.
        (validate / test of a checkpoint may use other settings; checkpoints without the record pass.)"""
        saved = state_dict.get("stream_settings")
        fitting = self.trainer is not None and self.trainer.state.fn == "fit"
        if not saved or not fitting or self.train_dataset is None:
            return
        now = self._stream_settings()
        differ = [f"{key}: checkpoint {saved[key]!r}, now {now[key]!r}" for key in now
                  if key in saved and saved[key] != now[key]]
        if differ:
            raise InputError(
                "resuming continues the checkpoint's training stream, which needs its data settings; these differ: "
                + "; ".join(differ) + ". (The prepared split's path follows data.data, data.tokenizer, "
                "data.val_fraction and data.cache_dir.) Resume with the checkpoint's settings")

    def shuffle_seed(self) -> int:
        """The explicit `seed`, else the global seed set by seed_everything (Lightning exports it), else 42."""
        if self.seed is not None:
            return self.seed
        return int(os.environ.get("PL_GLOBAL_SEED", 42))

    def _check_prebuilt(self, prepared: PreparedData) -> None:
        """A prebuilt dataset written by `prepare` records its tokenizer: refuse a mismatched one."""
        meta_file = Path(prepared.train_dir).parent / "meta.json"
        if not prepared.meta.get("prebuilt") or not meta_file.is_file():
            return
        meta = json.loads(meta_file.read_text())
        if (meta.get("vocab_size"), meta.get("eos_id")) != (self.vocab_size, self.eos_id):
            raise InputError(
                f"{prepared.train_dir} was tokenized with vocab_size={meta.get('vocab_size')}, eos_id={meta.get('eos_id')}"
                f" but the tokenizer given has vocab_size={self.vocab_size}, eos_id={self.eos_id}"
            )

    def _check_not_empty(self) -> None:
        if len(self.train_dataset) < self.batch_size:
            raise InputError(
                f"the training split holds {len(self.train_dataset)} blocks of {self.seq_len + 1} tokens (per rank), "
                f"fewer than one batch of {self.batch_size}: add data or lower seq_len / batch_size"
            )
        if self.val_dataset is not None and len(self.val_dataset) < self.val_batch_size:
            log.warning(
                "validation split holds %d blocks (< val_batch_size=%d): validation is off",
                len(self.val_dataset),
                self.val_batch_size,
            )
            self.val_dataset = None

    # ------------------------------------------------------------ loaders

    def _loader(self, dataset, batch_size: int):
        from litdata import StreamingDataLoader

        return StreamingDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=self.num_workers,
            drop_last=True,  # even batches on every rank, or DDP can hang (litData#233)
            collate_fn=collate_tokens,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self):
        if self.train_dataset is None:
            raise RuntimeError("call setup() (after prepare_data()) before train_dataloader()")
        return self._loader(self.train_dataset, self.batch_size)

    def val_dataloader(self):
        if self.val_dataset is None:
            return []  # no held-out split: Lightning then skips validation
        return self._loader(self.val_dataset, self.val_batch_size)

    def test_dataloader(self):
        """The held-out split (there is no separate test split: `test` reports test/loss on the validation
        documents, in whole batches as validation does, capped by Trainer `limit_test_batches`)."""
        return self._held_out("test")

    def predict_dataloader(self):
        """The held-out split (`predict` returns each sequence's mean next-token loss; in order on one device,
        split across ranks under DDP)."""
        return self._held_out("predict")

    def _held_out(self, stage: str):
        if self.val_dataset is None:
            raise InputError(f"`{stage}` needs a held-out split, but this data has none: set data.val_fraction > 0 "
                             "(documents are assigned to it by a hash of their text)")
        return self._loader(self.val_dataset, self.val_batch_size)

    def decode(self, ids) -> str:
        """Text of a token sequence (for samples and debugging)."""
        return self.tokenizer.decode(ids.tolist() if hasattr(ids, "tolist") else ids)
