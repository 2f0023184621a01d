"""TokenDataModule: tokenizer facts at __init__, int64 [B, T+1] batches, fixed validation, exact resume."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from datatest_helpers import byte_stream, write_jsonl, write_word_tokenizer

from mhar_lit.data import TokenDataModule
from mhar_lit.data.sources import InputError

SEQ = 31  # blocks of 32 tokens


@pytest.fixture
def corpus(tmp_path):
    docs = [f"doc {i}: " + "".join(chr(97 + (i * j) % 26) for j in range(40 + i % 60)) for i in range(400)]
    return write_jsonl(tmp_path / "docs.jsonl", docs), docs


def make_dm(path, tmp_path, **kw):
    args = dict(seq_len=SEQ, batch_size=4, num_workers=0, cache_dir=str(tmp_path / "cache"), val_fraction=0.1,
                chunk_tokens=4096, prep_workers=1)
    args.update(kw)
    dm = TokenDataModule([str(path)], **args)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_vocab_and_eos_are_known_at_init_without_touching_data(tmp_path):
    dm = TokenDataModule([str(tmp_path / "not-yet-there.jsonl")], cache_dir=str(tmp_path / "cache"))
    assert (dm.vocab_size, dm.eos_id) == (257, 256)
    assert not (tmp_path / "cache").exists()


def test_missing_tokenizer_path_fails_at_init_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="qwen3/tokenizer.json"):
        TokenDataModule(None, tokenizer=str(tmp_path / "qwen3" / "tokenizer.json"))


def test_setup_before_prepare_data_is_a_clear_error(corpus, tmp_path):
    dm = TokenDataModule([str(corpus[0])], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="run prepare_data"):
        dm.setup("fit")


def test_batches_are_int64_blocks_of_the_packed_stream(corpus, tmp_path):
    path, docs = corpus
    dm = make_dm(path, tmp_path, shuffle=False, val_fraction=0.0)
    batches = list(dm.train_dataloader())
    assert all(b.dtype == torch.int64 and b.shape == (4, SEQ + 1) for b in batches)
    blocks = torch.cat(batches).tolist()
    # Unshuffled blocks are the stream in order, minus each 4096-token chunk's sub-block tail.
    stream, expected, start = byte_stream(docs), [], 0
    while start < len(stream):
        chunk = stream[start : start + 4096]
        expected += [chunk[i : i + SEQ + 1] for i in range(0, len(chunk) - SEQ, SEQ + 1)]
        start += 4096
    assert blocks == expected[: len(blocks)] and len(expected) - len(blocks) < 4  # drop_last only


def test_shuffled_epoch_is_a_permutation_and_depends_on_seed(corpus, tmp_path):
    path, _ = corpus
    plain = torch.cat(list(make_dm(path, tmp_path, shuffle=False).train_dataloader()))
    shuffled = torch.cat(list(make_dm(path, tmp_path, seed=1).train_dataloader()))
    other = torch.cat(list(make_dm(path, tmp_path, seed=2).train_dataloader()))
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert not torch.equal(plain, shuffled) and not torch.equal(shuffled, other)
    # drop_last may drop a different partial batch, so compare all but the last batch's worth.
    assert len(set(key(shuffled)) - set(key(plain))) == 0 and abs(len(shuffled) - len(plain)) < 4


def test_validation_is_the_same_batches_every_evaluation(corpus, tmp_path):
    path, _ = corpus
    dm = make_dm(path, tmp_path, val_batch_size=2)
    loader = dm.val_dataloader()
    first_partial = [b for _, b in zip(range(3), loader)]  # like limit_val_batches=3
    full = list(loader)
    again = list(dm.val_dataloader())
    assert len(full) >= 5 and all(b.shape == (2, SEQ + 1) for b in full)
    assert all(torch.equal(a, b) for a, b in zip(first_partial, full))
    assert len(again) == len(full) and all(torch.equal(a, b) for a, b in zip(full, again))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_resumes_with_the_next_unseen_batch(corpus, tmp_path, num_workers):
    path, _ = corpus
    reference = list(make_dm(path, tmp_path, num_workers=num_workers).train_dataloader())
    loader = make_dm(path, tmp_path, num_workers=num_workers).train_dataloader()
    it = iter(loader)
    seen = [next(it) for _ in range(7)]
    state = loader.state_dict()
    del it
    fresh = make_dm(path, tmp_path, num_workers=num_workers).train_dataloader()
    fresh.load_state_dict(copy.deepcopy(state))  # load_state_dict mutates its argument
    rest = list(fresh)
    assert all(torch.equal(a, b) for a, b in zip(seen, reference[:7]))
    assert len(rest) == len(reference) - 7
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[7:]))


class Recorder(L.LightningModule):
    """Records every training batch; one weight so the optimizer has something to step."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        return (self.w - batch.float().mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(dm, tmp_path, max_steps, ckpt_path=None, callbacks=()):
    model = Recorder()
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks), default_root_dir=tmp_path,
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


def test_lightning_checkpoint_resume_continues_with_the_next_batch(corpus, tmp_path):
    path, _ = corpus
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    full = fit(make_dm(path, tmp_path), tmp_path, max_steps=7, callbacks=[ckpt])
    resumed = fit(make_dm(path, tmp_path), tmp_path, max_steps=7, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    assert len(full) == 7 and len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[3:]))


@pytest.mark.parametrize("change,named", [
    (dict(seq_len=SEQ - 8), "seq_len: checkpoint 31, now 23"),
    (dict(val_fraction=0.2), "prepared training split: checkpoint"),
    (dict(seed=5), "seed: checkpoint"),
])
def test_resume_with_other_stream_settings_names_them(corpus, tmp_path, change, named):
    """litdata refused these with its own state keys (block_size, input_dir path); the error names the setting.
    Validating or testing the same checkpoint with other settings stays allowed."""
    path, _ = corpus
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    fit(make_dm(path, tmp_path), tmp_path, max_steps=3, callbacks=[ckpt])
    last = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    with pytest.raises(ValueError, match=f"resuming continues the checkpoint's training stream.*{named}"):
        fit(make_dm(path, tmp_path, **change), tmp_path, max_steps=6, ckpt_path=last)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=1)
    assert trainer.validate(Validator(), datamodule=make_dm(path, tmp_path, **change), ckpt_path=last) == [{}]


def test_resume_with_other_num_workers_continues_the_stream(corpus, tmp_path):
    """litdata resumes across a change of workers itself (elastic resume), so the stream check leaves it alone."""
    path, _ = corpus
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    full = fit(make_dm(path, tmp_path), tmp_path, max_steps=6, callbacks=[ckpt])
    resumed = fit(make_dm(path, tmp_path, num_workers=1), tmp_path, max_steps=6,
                  ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(resumed, full[3:]))


class Validator(Recorder):
    def validation_step(self, batch, batch_idx):
        self.seen.append(batch.clone())


def test_embedded_corpus_gives_code_batches(tmp_path):
    dm = TokenDataModule(None, seq_len=63, batch_size=2, num_workers=0, cache_dir=str(tmp_path / "cache"),
                         max_corpus_bytes=100_000, val_fraction=0.05)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 64) and batch.dtype == torch.int64 and int(batch.max()) <= 256
    assert len(dm.train_dataset) > 1000 and dm.val_dataset is not None
    text = "".join(dm.decode(row) for row in torch.cat(list(dm.train_dataloader()))[:200])
    assert "def " in text and "import " in text


@pytest.mark.parametrize("val_batch_size", [0, -1])
def test_bad_val_batch_size_is_named(tmp_path, val_batch_size):
    """0 used to become batch_size silently, -1 failed in torch's DataLoader naming `batch_size`."""
    with pytest.raises(ValueError, match=f"val_batch_size must be positive .*got {val_batch_size}"):
        TokenDataModule(None, val_batch_size=val_batch_size, cache_dir=str(tmp_path / "cache"))


def test_too_little_data_for_one_batch_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "tiny.jsonl", ["just a few words"])
    dm = TokenDataModule([str(tmp_path / "tiny.jsonl")], seq_len=64, batch_size=2, val_fraction=0.0,
                         cache_dir=str(tmp_path / "cache"), prep_workers=1)
    dm.prepare_data()
    with pytest.raises(InputError, match="fewer than one batch"):
        dm.setup("fit")


def test_bpe_tokenizer_trains_on_the_inputs_and_feeds_batches(corpus, tmp_path):
    path, _ = corpus
    dm = make_dm(path, tmp_path, tokenizer="bpe:320")
    assert dm.vocab_size == 320 and dm.eos_id == 0  # the trainer puts <|endoftext|> first
    batches = torch.cat(list(dm.train_dataloader()))
    assert batches.shape[1:] == (SEQ + 1,) and int(batches.max()) < dm.vocab_size
    assert "<|endoftext|>doc " in dm.decode(batches[:20].flatten())
    eos_per_block = (batches == 0).sum(1).float().mean()
    assert 0.2 < eos_per_block < 2  # ~60-char documents, BPE-compressed into 32-token blocks


def test_prebuilt_dataset_is_streamed_and_checked_against_the_tokenizer(corpus, tmp_path):
    path, _ = corpus
    built = make_dm(path, tmp_path)
    prebuilt_root = str(Path(built._prepare(build=False).train_dir).parent)
    reused = make_dm(prebuilt_root, tmp_path / "elsewhere", shuffle=False)
    assert len(reused.train_dataset) == len(built.train_dataset) and reused.val_dataset is not None
    assert not (tmp_path / "elsewhere" / "cache").exists()  # nothing re-tokenized
    other_tok = str(write_word_tokenizer(tmp_path / "tok.json", ["<|im_end|>"]))
    with pytest.raises(ValueError, match="tokenized with vocab_size=257, eos_id=256"):
        make_dm(prebuilt_root, tmp_path / "elsewhere", tokenizer=other_tok)
