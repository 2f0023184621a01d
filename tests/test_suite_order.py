"""The order the suite's tests start in on xdist workers (tests/start_order.py): every named long test exists, and the
dealing keeps each group on one worker, in xdist's chunk sizes."""

from pathlib import Path

from start_order import LONGEST_FIRST, longest_first_chunks, xdist_chunk_sizes

REPO = Path(__file__).resolve().parents[1]


def test_every_named_long_test_is_defined():
    """A renamed or removed test would silently lose its place at the front of the run."""
    for _, *names in LONGEST_FIRST:
        for name in names:
            path, function = name.split("::")
            assert f"def {function.split('[')[0]}(" in (REPO / path).read_text(), name


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def __repr__(self) -> str:
        return self.nodeid


def test_groups_start_first_on_one_worker_each_in_xdist_chunk_sizes():
    (_, study), (_, sweep), (_, *ui) = LONGEST_FIRST[:3]
    others = [Item(f"tests/test_x.py::test_{i}") for i in range(7)]
    ui_items = [Item(name) for name in ui]
    items = [others[0], *ui_items, Item(sweep), others[1], Item(study), *others[2:]]
    chunks = longest_first_chunks(items, 2)
    assert [len(c) for c in chunks] == xdist_chunk_sizes(len(items), 2) == [6, 6]
    assert [i.nodeid for i in chunks[0][:1]] == [study] and [i.nodeid for i in chunks[1][:1]] == [sweep]
    assert chunks[1][1:4] == ui_items  # 92 s of the sweep against 123 of the study: the UI group joins the sweep
    assert sorted(map(repr, sum(chunks, []))) == sorted(map(repr, items))
    assert [i for c in chunks for i in c if i in others] == others  # the others keep their order
    assert xdist_chunk_sizes(23, 2) == [11, 12] and xdist_chunk_sizes(10, 3) == [3, 3, 4]
