"""tscale_p2p.data: tokenizer, sources, splits, windows, and every bad input refused cleanly."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from tscale_p2p.data import ByteTokenizer, Corpus, load_corpus
from tscale_p2p.errors import UserError


def write_docs(folder, docs: dict[str, str]) -> None:
    for name, text in docs.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def llmc_file(path, tokens, magic=20240520, version=1, count=None, dtype=np.uint16) -> None:
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())


def split_bytes(corpus: Corpus) -> tuple[bytes, bytes]:
    return corpus.train.tokens.tobytes(), corpus.val.tokens.tobytes()


def val_documents(corpus: Corpus) -> list[bytes]:
    data, starts = corpus.val.tokens.tobytes(), list(corpus.val.doc_starts) + [len(corpus.val)]
    return [data[a:b] for a, b in zip(starts, starts[1:])]


def snapshot(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello world\n", "naïve café — 東京 🚀", "\x00\x7f tabs\tand\r\n"])
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < tok.vocab_size == 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.decode(np.array(ids, dtype=np.uint8)) == text


def test_byte_tokenizer_rejects_ids_outside_its_vocabulary():
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer().decode([65, 300])


# ---- single text file: nanoGPT's shakespeare_char split ----------------------------------------


def test_text_file_splits_like_nanogpt_shakespeare_char(tmp_path):
    text = "".join(f"line {i}: to be or not to be\n" for i in range(300))
    path = tmp_path / "input.txt"
    path.write_text(text)
    corpus = load_corpus(str(path), cache_dir=tmp_path / "cache")
    n = len(text)
    assert split_bytes(corpus) == (text[: int(n * 0.9)].encode(), text[int(n * 0.9) :].encode())
    assert isinstance(corpus.train.tokens, np.memmap)
    assert corpus.vocab_size == 256 and corpus.bytes_per_token == 1.0
    assert corpus.bits_per_byte(np.log(2)) == pytest.approx(1.0)
    assert not (tmp_path / "cache").exists()  # a single file is read in place, never copied


def test_text_file_honours_val_fraction(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(32, 132)))
    corpus = load_corpus(str(path), cache_dir=tmp_path / "cache", val_fraction=0.25)
    assert (len(corpus.train), len(corpus.val)) == (75, 25)


# ---- folders: split by document, deterministic, cached ------------------------------------------


def make_folder(root, n=40):
    write_docs(root, {f"sub{i % 3}/doc{i:02d}.txt": f"document {i} " * (5 + i) for i in range(n)})


def test_folder_split_is_by_whole_document_and_deterministic(tmp_path):
    make_folder(tmp_path / "docs")
    a = load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c1")
    b = load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c2")
    assert split_bytes(a) == split_bytes(b)
    files = {p.read_bytes() for p in (tmp_path / "docs").rglob("*.txt")}
    val_docs = val_documents(a)
    assert 0 < len(val_docs) < 40 and all(doc in files for doc in val_docs)
    assert len(a.train) + len(a.val) == sum(len(f) for f in files)
    assert isinstance(a.train.tokens, np.memmap) and isinstance(a.val.tokens, np.memmap)


def test_folder_split_of_a_document_does_not_depend_on_the_other_files(tmp_path):
    make_folder(tmp_path / "docs")
    before = set(val_documents(load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c")))
    write_docs(tmp_path / "docs", {f"new/extra{i}.txt": f"extra {i} " * 9 for i in range(20)})
    after = set(val_documents(load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c")))
    assert before <= after  # the cache key saw the new files; old documents kept their side


def test_folder_skips_hidden_and_binary_files(tmp_path):
    write_docs(tmp_path / "d", {"a.txt": "alpha " * 50, "b.md": "beta " * 50, ".hidden": "secret " * 50,
                                ".git/config": "gitstuff " * 50})
    (tmp_path / "d" / "blob.bin").write_bytes(b"\0\1\2" * 100)
    corpus = load_corpus(str(tmp_path / "d"), cache_dir=tmp_path / "c")
    everything = b"".join(split_bytes(corpus))
    assert len(everything) == 300 + 250
    assert b"secret" not in everything and b"gitstuff" not in everything and b"\0" not in everything


@pytest.mark.parametrize("name", ["only.txt", "only21.txt"])  # their path hashes fall on either side
def test_folder_with_one_file_splits_it_by_position(tmp_path, name):
    write_docs(tmp_path / "d", {name: "0123456789" * 10})
    corpus = load_corpus(str(tmp_path / "d"), cache_dir=tmp_path / "c")
    assert split_bytes(corpus) == ((b"0123456789" * 9), b"0123456789")


def test_large_files_are_copied_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr("tscale_p2p.data._CHUNK_BYTES", 7)
    make_folder(tmp_path / "docs")
    chunked = load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c1")
    monkeypatch.undo()
    assert split_bytes(chunked) == split_bytes(load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c2"))


def test_cache_is_reused_and_built_atomically(tmp_path):
    make_folder(tmp_path / "docs")
    load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c")
    entries = list((tmp_path / "c" / "data").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # no temporary folder left
    before = {p.name: p.stat().st_mtime_ns for p in entries[0].iterdir()}
    load_corpus(str(tmp_path / "docs"), cache_dir=tmp_path / "c")
    assert {p.name: p.stat().st_mtime_ns for p in entries[0].iterdir()} == before


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    make_folder(tmp_path / "docs", n=5)
    monkeypatch.setenv("TSCALE_CACHE_DIR", str(tmp_path / "envcache"))
    load_corpus(str(tmp_path / "docs"))
    assert len(list((tmp_path / "envcache" / "data").iterdir())) == 1


def test_stdlib_source_is_real_python_and_cached(tmp_path):
    corpus = load_corpus("stdlib", cache_dir=tmp_path)
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 50_000
    assert b"def " in corpus.val.tokens[:200_000].tobytes()
    assert corpus.vocab_size == 256 and corpus.tokenizer is not None
    again = load_corpus("stdlib", cache_dir=tmp_path)
    assert again.description == corpus.description and len(list((tmp_path / "data").iterdir())) == 1


# ---- windows, seeds, resume, eval -------------------------------------------------------------


@pytest.fixture
def counting_corpus(tmp_path) -> Corpus:
    """Raw uint16 tokens 0, 1, 2, ...: every window says where it came from."""
    (tmp_path / "count.bin").write_bytes(np.arange(20_000, dtype="<u2").tobytes())
    return load_corpus(str(tmp_path / "count.bin"), cache_dir=tmp_path / "c")


def test_windows_come_from_the_memmap_and_targets_are_shifted(counting_corpus):
    x, y = next(counting_corpus.batches("train", 16, 32, seed=3))
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)
    assert torch.equal(x - x[:, :1], torch.arange(32).expand(16, 32))  # consecutive tokens
    assert int(x.min()) >= 0 and int(y.max()) < len(counting_corpus.train)  # never crosses into val
    assert isinstance(counting_corpus.train.tokens, np.memmap)


def test_peers_with_different_seeds_read_different_windows(counting_corpus):
    first = lambda seed: next(counting_corpus.batches("train", 8, 16, seed=seed))[0][:, 0]  # noqa: E731
    assert torch.equal(first(7), first(7))
    assert not torch.equal(first(7), first(8))
    batches = counting_corpus.batches("train", 8, 16, seed=7)
    assert not torch.equal(next(batches)[0], next(batches)[0])


def test_sampler_state_resumes_exactly(counting_corpus):
    batches = counting_corpus.batches("train", 4, 16, seed=11)
    for _ in range(3):
        next(batches)
    state = json.loads(json.dumps(batches.state_dict()))
    expected = [next(batches) for _ in range(3)]
    resumed = counting_corpus.batches("train", 4, 16, seed=0)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(3))):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_eval_batches_are_fixed_and_from_val(counting_corpus):
    val_start = len(counting_corpus.train)  # val is the tail of this file
    runs = [list(counting_corpus.eval_batches(4, 64, num_batches=3)) for _ in range(2)]
    assert len(runs[0]) == 3
    for (x, y), (x2, y2) in zip(*runs):
        assert torch.equal(x, x2) and torch.equal(y, x + 1)
        assert int(x.min()) >= val_start
    everything = list(counting_corpus.eval_batches(5, 64))  # every non-overlapping window once
    starts = torch.cat([x[:, 0] for x, _ in everything])
    assert torch.equal(starts, torch.arange(val_start, val_start + len(counting_corpus.val) - 64, 64))


# ---- tokenized .bin files ---------------------------------------------------------------------


def test_nanogpt_raw_bin_with_val_sibling(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.arange(1000, 3000, dtype="<u2").tobytes())
    (tmp_path / "val.bin").write_bytes(np.full(500, 4321, dtype="<u2").tobytes())
    corpus = load_corpus(str(tmp_path / "train.bin"), cache_dir=tmp_path / "c")
    assert list(corpus.train.tokens[:3]) == [1000, 1001, 1002] and len(corpus.train) == 2000
    assert len(corpus.val) == 500 and set(corpus.val.tokens.tolist()) == {4321}
    assert corpus.vocab_size == 4322  # largest id + 1 over both files
    assert corpus.bytes_per_token is None and corpus.bits_per_byte(1.0) is None and corpus.tokenizer is None
    assert "unknown" in corpus.description
    assert len(list((tmp_path / "c" / "data").glob("maxid-*.json"))) == 2  # the scans are remembered


def test_llmc_bin_header_is_read(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16) % 50257
    llmc_file(tmp_path / "tiny_shakespeare_train.bin", tokens)
    llmc_file(tmp_path / "tiny_shakespeare_val.bin", tokens[:700])
    corpus = load_corpus(str(tmp_path / "tiny_shakespeare_train.bin"), cache_dir=tmp_path / "c")
    assert np.array_equal(corpus.train.tokens, tokens) and np.array_equal(corpus.val.tokens, tokens[:700])
    assert corpus.vocab_size == 50257 and corpus.bytes_per_token is None


def test_llmc_llama3_bin_without_sibling_splits_its_tail(tmp_path):
    tokens = np.arange(1000, dtype=np.uint32) * 100
    llmc_file(tmp_path / "shard.bin", tokens, magic=20240801, version=7, dtype=np.uint32)
    corpus = load_corpus(str(tmp_path / "shard.bin"), cache_dir=tmp_path / "c")
    assert np.array_equal(corpus.train.tokens, tokens[:900]) and np.array_equal(corpus.val.tokens, tokens[900:])
    assert corpus.vocab_size == 128256
    x, y = next(corpus.batches("val", 2, 10, seed=0))
    assert torch.equal(y - x, torch.full((2, 10), 100))


# ---- Hugging Face datasets (a local dataset, no network) --------------------------------------


@pytest.fixture
def hf_folder(tmp_path):
    rows = [{"id": i, "body": f"row {i} says hello " * (3 + i % 5)} for i in range(60)]
    folder = tmp_path / "hfdata"
    folder.mkdir()
    (folder / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, rows


def test_hf_local_dataset_streams_into_the_cache(tmp_path, hf_folder, monkeypatch):
    folder, rows = hf_folder
    src = f"hf:{folder}:column=body"
    corpus = load_corpus(src, cache_dir=tmp_path / "c")
    texts = {r["body"].encode() for r in rows}
    assert set(val_documents(corpus)) <= texts and 0 < len(val_documents(corpus)) < 60
    assert len(corpus.train) + len(corpus.val) == sum(map(len, texts))
    assert corpus.bytes_per_token == 1.0
    monkeypatch.setitem(sys.modules, "datasets", None)  # cached: needs neither datasets nor the network
    assert split_bytes(load_corpus(src, cache_dir=tmp_path / "c")) == split_bytes(corpus)


def test_hf_max_tokens_stops_the_stream(tmp_path, hf_folder):
    folder, rows = hf_folder
    corpus = load_corpus(f"hf:{folder}:column=body:max_tokens=500", cache_dir=tmp_path / "c")
    assert 500 <= len(corpus.train) + len(corpus.val) < 500 + max(len(r["body"]) for r in rows)


# ---- bad input: one line naming the value, nothing on disk changed -----------------------------


def assert_refused(src: str, tmp_path, match: str, **kwargs) -> None:
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=match) as info:
        load_corpus(src, cache_dir=tmp_path / "cache", **kwargs)
    assert "\n" not in str(info.value)
    assert snapshot(tmp_path) == before and not (tmp_path / "cache").exists()


def test_missing_path_is_refused(tmp_path):
    assert_refused(str(tmp_path / "nope.txt"), tmp_path, "nope.txt.*does not exist")


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert_refused(str(tmp_path / "empty.txt"), tmp_path, "empty.txt.*empty")


def test_folder_without_text_files_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "image.png").write_bytes(b"\x89PNG\0\0\0")
    (tmp_path / "d" / "blank.txt").write_text("")
    assert_refused(str(tmp_path / "d"), tmp_path, "'.*d' holds no text files")


def test_odd_sized_bin_is_refused(tmp_path):
    (tmp_path / "tokens.bin").write_bytes(b"\1\0\2\0\3")
    assert_refused(str(tmp_path / "tokens.bin"), tmp_path, "tokens.bin.*odd byte count")


@pytest.mark.parametrize(
    "kwargs, match",
    [({"version": 3}, "version 3"), ({"count": 999}, "999 tokens"), ({"count": -1}, "-1 tokens")],
)
def test_corrupt_llmc_header_is_refused(tmp_path, kwargs, match):
    llmc_file(tmp_path / "data.bin", np.arange(100), **kwargs)
    assert_refused(str(tmp_path / "data.bin"), tmp_path, f"data.bin.*{match}")


@pytest.mark.parametrize("magic, version, dtype, bad_id", [(20240520, 1, np.uint16, 50257), (20240801, 7, np.uint32, 2**31)])
def test_llmc_token_ids_outside_the_header_s_vocabulary_are_refused(tmp_path, magic, version, dtype, bad_id):
    tokens = np.arange(200) % 50
    tokens[150] = bad_id
    llmc_file(tmp_path / "data.bin", tokens, magic=magic, version=version, dtype=dtype)
    assert_refused(str(tmp_path / "data.bin"), tmp_path, f"data.bin.*token id {bad_id} is outside the vocabulary")


def test_truncated_llmc_header_is_refused(tmp_path):
    (tmp_path / "data.bin").write_bytes(np.array([20240520, 1, 5], dtype="<i4").tobytes())
    assert_refused(str(tmp_path / "data.bin"), tmp_path, "data.bin.*header")


def test_unknown_hf_dataset_is_refused(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # loopback only: fail fast, no retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert_refused("hf:no-such-user/no-such-dataset", tmp_path, "no-such-user/no-such-dataset")


def test_hf_without_datasets_package_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert_refused("hf:roneneldan/TinyStories", tmp_path, "TinyStories.*needs the `datasets` package")


@pytest.mark.parametrize("option", ["colum=text", "split", "max_tokens=lots"])
def test_bad_hf_options_are_refused(tmp_path, option):
    assert_refused(f"hf:some/dataset:{option}", tmp_path, option.split("=")[0])


def test_hf_missing_column_is_refused(tmp_path, hf_folder):
    folder, _ = hf_folder
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="no column 'text'.*'body'"):
        load_corpus(f"hf:{folder}", cache_dir=tmp_path / "cache")
    assert snapshot(tmp_path) == before


def test_hf_bad_row_mid_stream_leaves_no_cache_entry(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    rows = [{"text": f"fine row {i} " * 20} for i in range(30)] + [{"text": 12345}]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match="holds int"):
        load_corpus(f"hf:{folder}", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "data").iterdir()) == []


def test_corpus_too_small_for_the_context_is_refused(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("x" * 1000)  # 900 train, 100 val
    corpus = load_corpus(str(path), cache_dir=tmp_path / "c")
    next(corpus.batches("train", 2, 899))
    with pytest.raises(UserError, match="train split has 900 tokens, too few for context 900"):
        corpus.batches("train", 2, 900)
    with pytest.raises(UserError, match="val split has 100 tokens.*context 128"):
        corpus.eval_batches(2, 128, 1)
    with pytest.raises(UserError, match="val split has 100 tokens.*context 128"):
        corpus.check_context(128)


def test_val_fraction_outside_zero_one_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("hello " * 100)
    assert_refused(str(tmp_path / "t.txt"), tmp_path, "val fraction.*1.5", val_fraction=1.5)
