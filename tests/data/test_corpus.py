"""Embedded corpus: sorted, test and site-packages dirs skipped, byte cap gives a prefix."""

import pytest

from mhar_lit.data.corpus import stdlib_corpus_files


@pytest.fixture
def fake_stdlib(tmp_path):
    files = {
        "zeta.py": "z = 1\n",
        "abc.py": "a = 1\n",
        "pkg/mod.py": "m = 2\n" * 3,
        "pkg/test/test_mod.py": "t = 3\n",
        "idlelib/idle_test/x.py": "x = 4\n",
        "site-packages/third.py": "s = 5\n",
        "pkg/data.txt": "not python",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def rel(paths, root):
    return [p.relative_to(root).as_posix() for p in paths]


def test_corpus_is_sorted_and_skips_tests_and_third_party(fake_stdlib):
    assert rel(stdlib_corpus_files(None, root=fake_stdlib), fake_stdlib) == ["abc.py", "pkg/mod.py", "zeta.py"]
    with_tests = rel(stdlib_corpus_files(None, skip_tests=False, root=fake_stdlib), fake_stdlib)
    assert with_tests == ["abc.py", "idlelib/idle_test/x.py", "pkg/mod.py", "pkg/test/test_mod.py", "zeta.py"]


def test_byte_cap_takes_a_prefix(fake_stdlib):
    # abc.py is 6 bytes, pkg/mod.py 18: a cap of 23 stops before mod.py, 24 includes it.
    assert rel(stdlib_corpus_files(23, root=fake_stdlib), fake_stdlib) == ["abc.py"]
    assert rel(stdlib_corpus_files(24, root=fake_stdlib), fake_stdlib) == ["abc.py", "pkg/mod.py"]
    with pytest.raises(ValueError, match="smaller than the first corpus file"):
        stdlib_corpus_files(5, root=fake_stdlib)


def test_real_stdlib_corpus_is_code_and_deterministic():
    files = stdlib_corpus_files(1_000_000)
    assert files == stdlib_corpus_files(1_000_000)
    assert 0 < sum(f.stat().st_size for f in files) <= 1_000_000
    everything = stdlib_corpus_files(None)
    assert files == everything[: len(files)]
    assert any(f.name == "os.py" for f in everything)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in everything)
