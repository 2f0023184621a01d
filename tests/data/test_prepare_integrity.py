"""Prepared data that cannot be silently wrong: chunk checksums, crash leftovers, non-string text fields."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datatest_helpers import DOCS, byte_stream, read_tokens, write_jsonl
from subprocess_env import python_path

from mhar_lit.data import integrity
from mhar_lit.data.prepare import prepare
from mhar_lit.data.sources import InputError
from mhar_lit.data.tokenizer import ByteTokenizer


def run(data, cache, **kw):
    kw.setdefault("val_fraction", 0.0)
    kw.setdefault("chunk_tokens", 64)  # several chunks
    kw.setdefault("num_workers", 1)
    return prepare(data, ByteTokenizer(), cache_dir=cache, **kw)


def first_chunk(prepared):
    return sorted(Path(prepared.train_dir).glob("chunk-*.bin"))[0]


def zero_fill(path):
    path.write_bytes(bytes(path.stat().st_size))


def truncate(path):
    os.truncate(path, path.stat().st_size - 8)


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # the last token: the header stays readable
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [zero_fill, truncate, flip_bytes])
def test_a_damaged_chunk_is_refused_naming_the_file_and_the_fix(txt_corpus, tmp_path, damage):
    cache = tmp_path / "cache"
    built = run([str(txt_corpus)], cache)
    chunk = first_chunk(built)
    damage(chunk)
    with pytest.raises(integrity.CorruptFileError, match=rf"{chunk}.*Delete {Path(built.train_dir).parent}"):
        run([str(txt_corpus)], cache)


def test_the_datamodule_verifies_before_training(txt_corpus, tmp_path):
    from mhar_lit.data import TokenDataModule

    args = dict(seq_len=7, batch_size=2, num_workers=0, cache_dir=str(tmp_path / "cache"), val_fraction=0.0,
                chunk_tokens=64, prep_workers=1)
    dm = TokenDataModule([str(txt_corpus)], **args)
    dm.prepare_data()
    zero_fill(first_chunk(dm._prepare(build=False)))
    with pytest.raises(integrity.CorruptFileError, match="does not match its sha256"):
        TokenDataModule([str(txt_corpus)], **args).prepare_data()


def test_each_file_is_read_once_per_process(txt_corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    built = run([str(txt_corpus)], cache)
    manifest = json.loads((Path(built.train_dir).parent / "checksums.json").read_text())
    assert set(manifest["files"]) == {f"train/{p.name}" for p in Path(built.train_dir).iterdir()}
    hashed = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    run([str(txt_corpus)], cache)
    run([str(txt_corpus)], cache)
    assert sorted(h for h in hashed if h.startswith("chunk-")) == sorted(
        p.name for p in Path(built.train_dir).glob("chunk-*.bin"))


HOLD_LOCK = """
import sys, time
from pathlib import Path
from mhar_lit.data import integrity
folder = Path(sys.argv[1]); folder.mkdir()
lock = integrity.hold_new_lock(folder / integrity.LOCK_NAME)
(folder / "partial.bin").write_bytes(b"x" * 100)
print("ready", flush=True)
time.sleep(600)
"""


def start_staging_owner(folder):
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_leftovers_of_an_interrupted_preparation_are_removed_but_not_a_live_one(txt_corpus, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead, live = cache / ".tokens-aaa.tmp-111-x", cache / ".tokens-bbb.tmp-222-y"
    killed = start_staging_owner(dead)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    owner = start_staging_owner(live)
    young, old = cache / ".tokens-ccc.tmp-333-z", cache / ".tokens-ddd.tmp-444-removing"
    young.mkdir()
    old.mkdir()
    long_ago = time.time() - 2 * integrity.UNLOCKED_GRACE_S
    os.utime(old, (long_ago, long_ago))
    try:
        built = run([str(txt_corpus)], cache)
        assert not dead.exists() and not old.exists()
        assert live.exists() and young.exists()  # a live build, and one too young to have taken its lock
    finally:
        owner.kill()
        owner.wait()
    assert read_tokens(built.train_dir) == byte_stream(DOCS)


def test_a_number_in_a_parquet_text_column_names_file_row_and_field(tmp_path):
    pq.write_table(pa.table({"text": [1.5, 2.5, 3.5]}), tmp_path / "nums.parquet")
    with pytest.raises(InputError, match=r"nums.parquet: row 0: field 'text' is float"):
        run([str(tmp_path / "nums.parquet")], tmp_path / "cache")
    pq.write_table(pa.table({"text": pa.array([b"ok", b"bytes"], pa.binary())}), tmp_path / "bin.parquet")
    with pytest.raises(InputError, match=r"bin.parquet: row 0: field 'text' is bytes"):
        run([str(tmp_path / "bin.parquet")], tmp_path / "cache")


def test_a_number_in_a_jsonl_text_field_names_file_line_and_field(tmp_path):
    bad = tmp_path / "mixed.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": null}\n{"text": 42}\n')
    with pytest.raises(InputError, match=r"mixed.jsonl: line 3: field 'text' is int"):
        run([str(bad)], tmp_path / "cache")


def test_null_texts_are_skipped_as_empty_documents(tmp_path):
    pq.write_table(pa.table({"text": ["a b", None, "c"]}), tmp_path / "nulls.parquet")
    write_jsonl(tmp_path / "nulls.jsonl", ["d", None])
    out = run([str(tmp_path / "nulls.parquet"), str(tmp_path / "nulls.jsonl")], tmp_path / "cache")
    assert read_tokens(out.train_dir) == byte_stream(["a b", "c", "d"])
