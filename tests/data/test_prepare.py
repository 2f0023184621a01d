"""Preparation: exact packed tokens, disjoint hash split, cache reuse/invalidation, atomic failures."""

import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datatest_helpers import DOCS, byte_stream, read_tokens, split_documents, write_jsonl

import mhar_lit.data.prepare as prep_mod
from mhar_lit.data.prepare import prepare
from mhar_lit.data.sources import InputError, is_validation
from mhar_lit.data.tokenizer import ByteTokenizer

BIG_CHUNK = 1 << 16  # larger than any test corpus: one chunk per worker, nothing dropped


def run(data, cache, **kw):
    kw.setdefault("val_fraction", 0.0)
    kw.setdefault("chunk_tokens", BIG_CHUNK)
    kw.setdefault("num_workers", 1)
    return prepare(data, ByteTokenizer(), cache_dir=cache, **kw)


def cache_entries(cache):
    """What a build left in the cache dir (finished datasets and temp dirs alike), not the input-digest memo."""
    return sorted(p.name for p in cache.iterdir() if p.name != prep_mod.DIGEST_MEMO) if cache.exists() else []


def test_tokens_are_documents_plus_eos_packed_in_order(txt_corpus, tmp_path):
    out = run([str(txt_corpus)], tmp_path / "cache")
    assert out.val_dir is None
    assert read_tokens(out.train_dir) == byte_stream(DOCS)
    assert out.meta["stats"]["train"] == {"tokens": len(byte_stream(DOCS)), "chunks": 1}


def test_training_blocks_are_the_stream_cut_into_seq_len_plus_one(txt_corpus, tmp_path):
    from litdata import StreamingDataset, TokensLoader

    out = run([str(txt_corpus)], tmp_path / "cache")
    ds = StreamingDataset(out.train_dir, item_loader=TokensLoader(block_size=17), shuffle=False)
    blocks = [ds[i].tolist() for i in range(len(ds))]
    stream = byte_stream(DOCS)
    assert len(blocks) == len(stream) // 17  # only the sub-block tail of the single chunk is dropped
    assert sum(blocks, []) == stream[: len(blocks) * 17]


def test_small_chunks_keep_the_stream_contiguous(txt_corpus, tmp_path):
    out = run([str(txt_corpus)], tmp_path / "cache", chunk_tokens=16)
    assert out.meta["stats"]["train"]["chunks"] > 8
    assert read_tokens(out.train_dir) == byte_stream(DOCS)


def test_validation_split_is_the_hashed_documents_and_disjoint(tmp_path):
    docs = [f"document number {i}: {'x' * (i % 7)}" for i in range(200)]
    corpus = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = run([str(corpus)], tmp_path / "cache", val_fraction=0.2)
    train = split_documents(read_tokens(out.train_dir))
    val = split_documents(read_tokens(out.val_dir))
    assert val == [d for d in docs if is_validation(d, 0.2)]
    assert train == [d for d in docs if not is_validation(d, 0.2)]
    assert not set(train) & set(val) and len(train) + len(val) == 200
    assert 20 <= len(val) <= 60  # about a fifth


def test_worker_count_changes_neither_the_tokens_nor_the_fingerprint(tmp_path, monkeypatch):
    """1 and 2 preparation workers write byte-identical chunks: the stream is a function of the data only."""
    monkeypatch.setattr(prep_mod, "BATCH_DOCS", 3)  # many small tasks in flight: completion order varies
    root = tmp_path / "corpus"
    root.mkdir()
    docs = [f"file {i} says {'abc' * i}" for i in range(40)]
    for i, d in enumerate(docs):
        (root / f"{i:02d}.txt").write_text(d)
    one = run([str(root)], tmp_path / "c1", val_fraction=0.25, chunk_tokens=64)
    two = run([str(root)], tmp_path / "c2", val_fraction=0.25, chunk_tokens=64, num_workers=2)
    assert Path(one.train_dir).parent.name == Path(two.train_dir).parent.name  # same fingerprint
    for split in ("train_dir", "val_dir"):
        a, b = Path(getattr(one, split)), Path(getattr(two, split))
        assert read_tokens(a) == read_tokens(b) and len(read_tokens(a)) > 0
        chunks = sorted(p.name for p in a.glob("chunk-*.bin"))
        assert len(chunks) > 1 and chunks == sorted(p.name for p in b.glob("chunk-*.bin"))
        assert all((a / c).read_bytes() == (b / c).read_bytes() for c in chunks)
        assert (a / "index.json").read_bytes() == (b / "index.json").read_bytes()
    expected_train = [d for d in docs if not is_validation(d, 0.25)]
    assert split_documents(read_tokens(one.train_dir)) == expected_train  # input order, not worker order


def test_cache_is_reused_and_invalidated_by_edits(txt_corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = run([str(txt_corpus)], cache)
    calls = []
    real = prep_mod._build
    monkeypatch.setattr(prep_mod, "_build", lambda *a, **k: calls.append(1) or real(*a, **k))

    again = run([str(txt_corpus)], cache)
    assert again.train_dir == first.train_dir and calls == []  # no optimize: cache hit

    (txt_corpus / "doc02.txt").write_text("short, now longer")
    changed = run([str(txt_corpus)], cache)
    assert changed.train_dir != first.train_dir and calls == [1]
    expected = DOCS[:2] + ["short, now longer"] + DOCS[3:]
    assert read_tokens(changed.train_dir) == byte_stream(expected)

    other_split = run([str(txt_corpus)], cache, val_fraction=0.5)
    assert other_split.train_dir not in (first.train_dir, changed.train_dir)
    entries = cache_entries(cache)
    assert len(entries) == 3 and all(name.startswith("tokens-") for name in entries)  # no temp dirs left


def test_touching_a_file_does_not_rebuild(txt_corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = run([str(txt_corpus)], cache)
    calls = []
    real = prep_mod._build
    monkeypatch.setattr(prep_mod, "_build", lambda *a, **k: calls.append(1) or real(*a, **k))
    for f in txt_corpus.iterdir():
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    again = run([str(txt_corpus)], cache)
    assert again.train_dir == first.train_dir and calls == []


def test_only_the_newest_builds_of_one_source_are_kept(txt_corpus, tmp_path):
    cache = tmp_path / "cache"
    other = run([str(txt_corpus)], cache, val_fraction=0.5)  # other settings: another source, never pruned
    builds = []
    for version in range(4):
        (txt_corpus / "doc02.txt").write_text(f"short, version {version}")
        builds.append(Path(run([str(txt_corpus)], cache).train_dir).parent.name)
    kept = prep_mod.KEEP_COPIES
    assert cache_entries(cache) == sorted(builds[-kept:] + [Path(other.train_dir).parent.name])


def test_build_false_never_builds(txt_corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="run prepare_data"):
        run([str(txt_corpus)], tmp_path / "cache", build=False)
    assert cache_entries(tmp_path / "cache") == []


def test_missing_path_glob_and_empty_inputs_are_named_errors(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(InputError, match="does not exist: .*nowhere.txt"):
        run([str(tmp_path / "nowhere.txt")], cache)
    with pytest.raises(InputError, match=r"glob pattern .*\*.jsonl' matched no files"):
        run([str(tmp_path / "*.jsonl")], cache)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(InputError, match="holds no input files"):
        run([str(tmp_path / "emptydir")], cache)
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(InputError, match="contain no documents"):
        run([str(tmp_path / "blank.txt")], cache)
    (tmp_path / "notes.csv").write_text("a,b")
    with pytest.raises(InputError, match="unsupported input file .*notes.csv"):
        run([str(tmp_path / "notes.csv")], cache)
    assert cache_entries(cache) == []


def test_jsonl_with_only_empty_texts_is_empty_input_and_leaves_no_cache(tmp_path):
    corpus = write_jsonl(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(InputError, match="contain no documents"):
        run([str(corpus)], tmp_path / "cache", val_fraction=0.1)
    assert cache_entries(tmp_path / "cache") == []


def test_error_inside_a_worker_names_the_line_and_leaves_no_cache(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "wrong field"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: no field 'text'"):
        run([str(bad)], tmp_path / "cache")
    assert cache_entries(tmp_path / "cache") == []


def test_non_utf8_file_is_skipped_counted_and_named(txt_corpus, tmp_path, caplog):
    bad = txt_corpus / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="mhar_lit.data.prepare"):
        out = run([str(txt_corpus)], tmp_path / "cache")
    assert out.meta["skipped_files"] == [str(bad.resolve())]
    assert "skipped 1 input file(s) that are not valid UTF-8" in caplog.text and "latin1.txt" in caplog.text
    assert read_tokens(out.train_dir) == byte_stream(DOCS)


def test_non_utf8_file_with_strict_is_an_error_and_leaves_no_cache(txt_corpus, tmp_path):
    (txt_corpus / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(InputError, match="not valid UTF-8: .*latin1.txt"):
        run([str(txt_corpus)], tmp_path / "cache", strict=True)
    assert cache_entries(tmp_path / "cache") == []


def test_parquet_and_jsonl_with_a_custom_text_field(tmp_path):
    pq.write_table(pa.table({"content": DOCS[:5], "n": list(range(5))}), tmp_path / "a.parquet", row_group_size=2)
    write_jsonl(tmp_path / "b.jsonl", DOCS[5:], field="content")
    out = run([str(tmp_path / "*.parquet"), str(tmp_path / "b.jsonl")], tmp_path / "cache", text_field="content")
    assert read_tokens(out.train_dir) == byte_stream(DOCS)


def test_parquet_without_the_text_column_names_it(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(InputError, match=r"no column 'text' \(columns: \['body'\]\)"):
        run([str(tmp_path / "a.parquet")], tmp_path / "cache")


def test_an_optimized_dataset_is_used_as_is(txt_corpus, tmp_path):
    built = run([str(txt_corpus)], tmp_path / "cache", val_fraction=0.5)
    direct = run([built.train_dir], tmp_path / "other")
    assert (direct.train_dir, direct.val_dir, direct.meta) == (built.train_dir, None, {"prebuilt": True})
    parent = run([str(tmp_path / "cache" / built.train_dir.split("/")[-2])], tmp_path / "other")
    assert (parent.train_dir, parent.val_dir) == (built.train_dir, built.val_dir)
    remote = run(["s3://bucket/tokens/train"], tmp_path / "other")
    assert remote.train_dir == "s3://bucket/tokens/train"
    assert cache_entries(tmp_path / "other") == []
    with pytest.raises(InputError, match="must be the only input"):
        run([built.train_dir, str(txt_corpus)], tmp_path / "other")
