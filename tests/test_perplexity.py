"""mhar_lit.eval.perplexity: the library function against a direct loss computation with the model's forward, on a
text file and on a prepared (litdata) corpus."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_generation import randomised_model

from mhar_lit.convert import save_pretrained
from mhar_lit.data.tokenizer import ByteTokenizer
from mhar_lit.eval.perplexity import perplexity

TEXT = "The cat sat on the mat. Über naïve cafés, 日本語 text; " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = randomised_model("delta", 4)
    folder = tmp_path_factory.mktemp("ppl") / "model"
    save_pretrained(model, folder)
    return model, folder


def direct_loss(model, windows):
    """Sum of next-token NLL (nats) and target count over windows, one plain forward each."""
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            window = torch.tensor(window)
            logits = model(window[None, :-1])[0]
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
            count += len(window) - 1
    return total, count


def test_text_file_perplexity_equals_the_direct_loss(model_dir, tmp_path):
    model, folder = model_dir
    (tmp_path / "held_out.txt").write_text(TEXT, encoding="utf-8")
    ids = list(TEXT.encode()) + [ByteTokenizer().eos_id]  # one document followed by EOS
    windows = [ids[i:i + 33] for i in range(0, len(ids) - 1, 32)]  # overlapping by one token
    total, count = direct_loss(model, windows)
    result = perplexity(folder, tmp_path / "held_out.txt", seq_len=32, batch_size=3, tokenizer="bytes",
                        device="cpu", dtype="float32")
    assert result.tokens == count == len(ids) - 1 and result.windows == len(windows) and result.seq_len == 32
    assert result.loss == pytest.approx(total / count, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-6)
    capped = perplexity(folder, tmp_path / "held_out.txt", seq_len=32, tokenizer="bytes", device="cpu",
                        dtype="float32", max_tokens=50)
    total, count = direct_loss(model, [ids[:33], ids[32:51]])
    assert capped.tokens == count == 50 and capped.loss == pytest.approx(total / count, rel=1e-6)


def test_prepared_corpus_perplexity_equals_the_direct_loss(model_dir, tmp_path):
    from mhar_lit.data.prepare import prepare

    model, folder = model_dir
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT, encoding="utf-8")
    prepared = prepare([str(tmp_path / "docs")], ByteTokenizer(), cache_dir=tmp_path / "cache", val_fraction=0.0)
    ids = list(TEXT.encode()) + [ByteTokenizer().eos_id]
    blocks = [ids[i:i + 17] for i in range(0, len(ids) - 16, 17)]  # blocks of seq_len + 1, the tail dropped
    total, count = direct_loss(model, blocks)
    for data in (prepared.train_dir, str(tmp_path / "cache" / next((tmp_path / "cache").glob("tokens-*")).name)):
        result = perplexity(folder, data, seq_len=16, split="train", device="cpu", dtype="float32")
        assert result.tokens == count and result.windows == len(blocks)
        assert result.loss == pytest.approx(total / count, rel=1e-6)


def test_bad_arguments_are_one_line_errors(model_dir, tmp_path):
    _, folder = model_dir
    (tmp_path / "t.txt").write_text("abc")
    (tmp_path / "empty").mkdir()
    cases = [(dict(data=tmp_path / "missing.txt"), FileNotFoundError, "missing.txt does not exist"),
             (dict(data=tmp_path / "empty"), FileNotFoundError, "is not a prepared corpus"),
             (dict(data=tmp_path / "t.txt", seq_len=10_000), ValueError, "seq_len must be between 1 and"),
             (dict(data=tmp_path / "t.txt", dtype="int8"), ValueError, "unknown dtype 'int8'"),
             (dict(data=tmp_path / "t.txt", batch_size=0), ValueError, "batch_size must be >= 1")]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match) as info:
            perplexity(folder, tokenizer="bytes", device="cpu", **kwargs)
        assert "\n" not in str(info.value)


def test_a_checkpoint_is_verified_on_a_prepared_corpus_as_on_a_text_file(tmp_path):
    """A .ckpt without its sha256 sidecar is refused for a prepared corpus too (it loads without a tokenizer,
    through the same reader), read with allow_unverified, and scores the same once its digest is recorded."""
    from mhar_lit.checkpoint import UnverifiedCheckpointError, record_checksum
    from mhar_lit.data.prepare import prepare
    from mhar_lit.lit.module import LanguageModel

    module = LanguageModel(size="tiny")
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    ckpt = tmp_path / "last.ckpt"
    torch.save(checkpoint, ckpt)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT, encoding="utf-8")
    prepared = prepare([str(tmp_path / "docs")], ByteTokenizer(), cache_dir=tmp_path / "cache", val_fraction=0.0)
    options = dict(seq_len=16, split="train", device="cpu", dtype="float32")
    with pytest.raises(UnverifiedCheckpointError, match="--allow_unverified"):
        perplexity(ckpt, prepared.train_dir, **options)
    unverified = perplexity(ckpt, prepared.train_dir, allow_unverified=True, **options)
    record_checksum(ckpt)
    assert perplexity(ckpt, prepared.train_dir, **options).loss == unverified.loss
