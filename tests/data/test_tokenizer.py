"""Tokenizers: byte ids, tokenizer.json loading with EOS resolution, local BPE training and caching."""

import pickle

import numpy as np
import pytest
from datatest_helpers import write_word_tokenizer

from mhar_lit.data import tokenizer as tok_mod
from mhar_lit.data.tokenizer import ByteTokenizer, load_tokenizer


def test_bytes_tokenizer_ids_are_utf8_bytes_and_eos_is_256():
    tk = load_tokenizer("bytes")
    assert (tk.vocab_size, tk.eos_id) == (257, 256)
    (ids,) = tk.encode_batch(["hé"])
    assert ids.dtype == np.int32 and ids.tolist() == [104, 195, 169]
    assert tk.decode([104, 195, 169, 256]) == "hé"


def test_bytes_tokenizer_rejects_an_eos_override():
    with pytest.raises(ValueError, match="fixed EOS"):
        load_tokenizer("bytes", eos=0)


def test_hf_tokenizer_prefers_im_end_then_endoftext(tmp_path):
    both = write_word_tokenizer(tmp_path / "both.json", ["<|endoftext|>", "<|im_end|>"])
    tk = load_tokenizer(str(both))
    assert (tk.vocab_size, tk.eos_id) == (6, 5)  # <|im_end|>, as docs/method.md J9 requires for Qwen3
    only_eot = write_word_tokenizer(tmp_path / "eot.json", ["<|endoftext|>"])
    assert load_tokenizer(str(only_eot)).eos_id == 4
    assert load_tokenizer(str(both), eos="<|endoftext|>").eos_id == 4
    assert load_tokenizer(str(both), eos=2).eos_id == 2


def test_hf_tokenizer_encodes_without_special_tokens(tmp_path):
    tk = load_tokenizer(str(write_word_tokenizer(tmp_path / "t.json", ["<|im_end|>"])))
    assert [a.tolist() for a in tk.encode_batch(["hello world", "again zzz"])] == [[1, 2], [3, 0]]


def test_hf_tokenizer_without_eos_token_is_an_error(tmp_path):
    path = write_word_tokenizer(tmp_path / "none.json", [])
    with pytest.raises(ValueError, match=r"none of the EOS tokens"):
        load_tokenizer(str(path))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        load_tokenizer(str(path), eos=99)


def test_missing_tokenizer_path_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="nope/tokenizer.json"):
        load_tokenizer(str(missing))


@pytest.mark.parametrize("text", ['{"version": "1.0"', '{"architectures": ["LlamaForCausalLM"]}'])
def test_unreadable_tokenizer_file_names_the_file(tmp_path, text):
    """A truncated tokenizer.json or another JSON file (a model's config.json) is named in the error."""
    path = tmp_path / "tok.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"cannot read tokenizer .*tok\.json: .*expected a Hugging Face tokenizer"):
        load_tokenizer(str(path))


def test_hf_tokenizer_pickles_by_path(tmp_path):
    tk = load_tokenizer(str(write_word_tokenizer(tmp_path / "t.json", ["<|im_end|>"])))
    clone = pickle.loads(pickle.dumps(tk))
    assert (clone.eos_id, clone.vocab_size, clone.fingerprint) == (tk.eos_id, tk.vocab_size, tk.fingerprint)
    assert clone.encode_batch(["world hello"])[0].tolist() == [2, 1]


def test_bpe_is_trained_once_then_loaded_from_cache(tmp_path, monkeypatch):
    texts = ["def foo(x):\n    return x * 2\n"] * 50 + ["print('hello world')\n"] * 50
    tk = load_tokenizer("bpe:300", cache_dir=tmp_path, bpe_texts=lambda: iter(texts), bpe_texts_key="k1")
    assert tk.vocab_size <= 300 and tk.eos_id == tk._tk.token_to_id("<|endoftext|>")
    (ids,) = tk.encode_batch([texts[0]])
    assert len(ids) < len(texts[0]) and tk.decode(ids.tolist()) == texts[0]  # merges learned, lossless
    cached = list((tmp_path / "tokenizers").glob("bpe-300-*.json"))
    assert len(cached) == 1

    def fail(*args, **kwargs):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tok_mod, "train_bpe", fail)
    again = load_tokenizer("bpe:300", cache_dir=tmp_path, bpe_texts=lambda: iter(texts), bpe_texts_key="k1")
    assert again.fingerprint == tk.fingerprint


def test_bad_bpe_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="bpe:<vocab size>"):
        load_tokenizer("bpe:many")


def test_byte_tokenizer_survives_lone_surrogates():
    (ids,) = ByteTokenizer().encode_batch(["a\ud800b"])
    assert ids.tolist() == [97, 63, 98]  # the surrogate becomes "?" instead of crashing the run
