"""The one atomic-write helper: a file or a folder appears whole under its name, or not at all."""

import pytest

from tscale_p2p.atomic import atomic_directory, atomic_file, write_atomically


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one_and_no_temporary(tmp_path):
    path = tmp_path / "deep" / "note.json"
    write_atomically(path, b"old")
    assert path.read_bytes() == b"old"
    with pytest.raises(OSError, match="disk full"):
        with atomic_file(path) as temporary:
            temporary.write_bytes(b"half of the n")
            raise OSError(28, "disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["note.json"]
    write_atomically(path, b"new")
    assert path.read_bytes() == b"new"


def test_a_folder_appears_whole_replaces_an_empty_one_and_never_a_full_one(tmp_path):
    target = tmp_path / "cache" / "corpus"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target) as folder:
            (folder / "train.u8").write_bytes(b"abc")
            raise KeyboardInterrupt  # Ctrl+C halfway: nothing is left behind
    assert list((tmp_path / "cache").iterdir()) == []
    target.mkdir()
    with atomic_directory(target) as folder:
        (folder / "train.u8").write_bytes(b"abc")
        (folder / "sub").mkdir()
        (folder / "sub" / "meta.json").write_text("{}")
    assert (target / "train.u8").read_bytes() == b"abc" and (target / "sub" / "meta.json").read_text() == "{}"
    with pytest.raises(OSError):  # another writer got there first: theirs stays
        with atomic_directory(target) as folder:
            (folder / "train.u8").write_bytes(b"xyz")
    assert (target / "train.u8").read_bytes() == b"abc"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["corpus"]
