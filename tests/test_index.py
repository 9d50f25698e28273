"""The longest-earlier-match index: build and lookup against brute force, the history-only rule, the model input,
training, generation, and every bad index it must refuse."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np
import pytest
import torch

from tscale_p2p.checkpoint import find_latest, load_checkpoint
from tscale_p2p.cli import main
from tscale_p2p.config import TrainConfig
from tscale_p2p.data import ByteTokenizer, TokenStream, load_corpus
from tscale_p2p.errors import UserError
from tscale_p2p.generate import GenerationEngine, SamplingParams, generate
from tscale_p2p.index import MAX_MATCH, TokenIndex, build_index
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.trainer import Trainer

REAL_TEXT = Path(inspect.__file__).read_bytes()  # real text every Python install has


def corpus_of(tokens) -> SimpleNamespace:
    """A corpus whose train split is `tokens` (byte tokens), as `load_corpus` would give."""
    tokens = np.frombuffer(tokens, np.uint8) if isinstance(tokens, bytes) else np.asarray(tokens, dtype=np.uint8)
    return SimpleNamespace(train=TokenStream("train", tokens), tokenizer=ByteTokenizer(), vocab_size=256,
                           source="test", description="test tokens")


def built(tmp_path, tokens, name="index") -> TokenIndex:
    return TokenIndex.open(build_index(corpus_of(tokens), tmp_path / name))


def match_lengths(corpus: np.ndarray, context: np.ndarray, end: int) -> np.ndarray:
    """Brute force: for every j < end, how many tokens the context (read backwards from its last) shares with
    the corpus read backwards from j, at most MAX_MATCH."""
    lengths = np.zeros(end, dtype=np.int64)
    alive = np.ones(end, dtype=bool)
    j = np.arange(end)
    for k in range(min(MAX_MATCH, len(context))):
        alive &= j - k >= 0
        alive[alive] &= corpus[j[alive] - k] == context[-1 - k]
        lengths += alive
    return lengths


def check_against_brute_force(corpus: np.ndarray, context: np.ndarray, end: int, token: int, length: int) -> None:
    """The answer has the longest match over occurrences ending before `end`, and its token follows one of them."""
    lengths = match_lengths(corpus, context, end)
    best = int(lengths.max()) if end else 0
    assert length == best
    if best == 0:
        assert token == 256  # no match: the no-match token
    else:
        assert token in set(corpus[np.flatnonzero(lengths == best) + 1].tolist())


def random_texts():
    rng = np.random.default_rng(0)
    for alphabet in (1, 2, 4, 256):
        yield rng.integers(0, alphabet, int(rng.integers(2, 400)))
    piece = rng.integers(0, 3, 50)
    yield np.concatenate([piece, rng.integers(0, 3, 30), piece, piece[:40], piece])  # duplicates past MAX_MATCH
    yield np.frombuffer(REAL_TEXT[:1500], dtype=np.uint8)


@pytest.mark.parametrize("case", range(6))
def test_stored_answers_are_the_longest_strictly_earlier_match(tmp_path, case):
    tokens = np.asarray(list(random_texts())[case], dtype=np.uint8)
    index = built(tmp_path, tokens)
    stored = index.history_matches(np.array([0]), len(tokens))[0]
    for i in range(len(tokens)):
        # History only: occurrences end before i, so the answer token t[j+1] is at most t[i], never t[i+1].
        check_against_brute_force(tokens, tokens[: i + 1], i, *stored[i].tolist())


def test_a_position_never_sees_itself_or_later_text(tmp_path):
    # Every token is new: any answer would have to come from the position itself or from later text.
    tokens = np.arange(200, dtype=np.uint8)
    index = built(tmp_path, np.concatenate([tokens, tokens]))
    stored = index.history_matches(np.array([0]), 400)[0]
    assert stored[:200, 1].eq(0).all()
    # The second copy matches the first, and always predicts the token after position i in the first copy,
    # which equals its own next token: correct, and learned from history only.
    assert stored[200:, 1].tolist() == [min(MAX_MATCH, k + 1) for k in range(200)]
    assert stored[200:399, 0].tolist() == list(range(1, 200))


def test_stored_answers_equal_the_lookup_restricted_to_history_at_every_position(tmp_path):
    rng = np.random.default_rng(1)
    real = np.frombuffer(REAL_TEXT[:20000], dtype=np.uint8)
    repeats = np.tile(rng.integers(0, 2, 70), 20)  # long full-length blocks: the block rule decides the token
    for name, tokens in (("real", real), ("repeats", repeats), ("random", rng.integers(0, 3, 3000))):
        index = built(tmp_path, tokens, name)
        stored = index.history_matches(np.array([0]), len(tokens))[0]
        assert torch.equal(stored, index.history_lookup()), name


def test_lookup_of_text_not_in_the_index_matches_brute_force(tmp_path):
    rng = np.random.default_rng(2)
    corpus = np.frombuffer(REAL_TEXT[:5000], dtype=np.uint8)
    index = built(tmp_path, corpus)
    windows = np.stack([
        np.frombuffer(REAL_TEXT[9000:9040], dtype=np.uint8),  # real text beyond the indexed part
        corpus[1000:1040],  # indexed text: matches grow to MAX_MATCH
        rng.integers(0, 256, 40),  # noise: mostly one-token matches
    ]).astype(np.int64)
    first = np.array([0, 5, 0])  # row 1 starts its context at column 5
    found = index.lookup(torch.from_numpy(windows), first)
    assert found.shape == (3, 40, 2)
    for b in range(3):
        for t in range(40):
            if t < first[b]:
                assert found[b, t].tolist() == [256, 0]
                continue
            # Any occurrence with a next token, i.e. ending before the last indexed position.
            check_against_brute_force(corpus, windows[b, first[b] : t + 1], len(corpus) - 1, *found[b, t].tolist())
    assert found[1, 5 + MAX_MATCH :, 1].eq(MAX_MATCH).all()
    # numba's own thread pool, not OpenMP: its OpenMP layer left torch's CPU ops ~300x slower after a lookup.
    assert numba.threading_layer() == "workqueue"
    assert torch.equal(index.lookup_last([windows[0, :17].tolist()])[0], found[0, 16])


def test_build_refuses_a_folder_in_use_and_leaves_nothing_half_written(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        build_index(corpus_of(b"abcabc"), tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    build_index(corpus_of(b"abcabc"), tmp_path / "empty-is-fine")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-is-fine", "full"]  # no temporary folder left


# ---- the model input, training and generation --------------------------------------------------------


TINY = ["--model", "e32h2d2w32", "--batch-size", "8", "--device", "cpu", "--log-every", "5", "--eval-batches", "2"]


@pytest.fixture
def indexed(corpus, tmp_path) -> Path:
    assert main(["index", "build", "--data", str(corpus), "--out", str(tmp_path / "index")]) == 0
    return tmp_path / "index"


def test_without_an_index_the_model_and_its_config_are_as_before():
    cfg = ModelConfig.from_dims("e32h2d2w32")
    assert "index" not in cfg.to_dict()
    assert not any("index" in name for name, _ in Transformer(cfg).named_parameters())
    with_index = cfg.with_(index="ab" * 32)
    assert ModelConfig.from_dict(with_index.to_dict()) == with_index
    names = {name for name, _ in Transformer(with_index).named_parameters()}
    assert {"index_token_emb.weight", "index_length_emb.weight"} <= names


def test_a_model_with_the_index_trains_its_loss_falls_and_the_checkpoint_records_it(corpus, indexed, tmp_path, caplog):
    caplog.set_level("INFO")
    out = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--index", str(indexed), "--out", str(out), "--steps", "40", "--lr", "1e-2",
            "--warmup", "5", "--eval-every", "20", *TINY]
    assert main(argv) == 0
    val = [float(r.getMessage().split("val loss ")[1].split()[0]) for r in caplog.records if "val loss" in r.getMessage()]
    assert len(val) == 2 and val[-1] < val[0] < 5.0  # from ln(256) = 5.5 at the start
    saved = load_checkpoint(find_latest(out))
    assert saved.model_config["index"] == json.loads((indexed / "index.json").read_text())["corpus_hash"]
    assert "index_token_emb.weight" in saved.model_state


def test_training_windows_carry_the_stored_answers_and_evaluation_the_lookup(corpus, indexed):
    data = load_corpus(str(corpus))
    index = TokenIndex.open(indexed, corpus=data)
    cfg = TrainConfig(data=str(corpus), index=str(indexed), batch_size=4, device="cpu")
    trainer = Trainer(ModelConfig.from_dims("e32h2d2w32", index=index.corpus_hash), cfg, data, torch.device("cpu"))
    x, y, matches = next(trainer.train_batches)
    assert matches.shape == (4, 32, 2)
    # The regular corpus repeats: the history answers of its windows mostly name their own next tokens.
    assert (matches[..., 0] == y).float().mean() > 0.9
    x_val, _ = next(iter(data.eval_batches(2, 32, 1)))
    assert torch.equal(trainer._lookup(x_val), index.lookup(x_val))


@pytest.mark.slow
def test_generation_with_the_index_equals_recomputation_with_lookups(tmp_path):
    tokens = np.frombuffer(REAL_TEXT[:4000], dtype=np.uint8)
    index = built(tmp_path, tokens)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dims("e64h4d3w48", short_window=8, first_window=4,
                                              index=index.corpus_hash)).eval()
    prompts = [list(REAL_TEXT[100:120]), list(b"x")]
    seqs = generate(GenerationEngine(model, slots=2, index=index), prompts, SamplingParams(max_tokens=30, temperature=0))
    for seq in seqs:
        idx = list(seq.prompt)
        with torch.no_grad():
            for token in seq.tokens:
                x = torch.tensor([idx])
                assert model(x, index.lookup(x))[0, -1].argmax().item() == token
                idx.append(token)
    with pytest.raises(UserError, match="reads an index"):
        GenerationEngine(model)


@pytest.mark.slow
def test_infer_with_the_index_generates(corpus, indexed, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--index", str(indexed), "--out", str(out), "--steps", "30",
                 "--lr", "1e-2", "--warmup", "5", "--eval-every", "0", *TINY]) == 0
    capsys.readouterr()
    assert main(["infer", "--checkpoint", str(out), "--index", str(indexed), "--prompt", "the cat sat on the ",
                 "--max-tokens", "12", "--temperature", "0", "--device", "cpu"]) == 0
    text, err = capsys.readouterr()
    assert len(text.encode()) >= 10 and "12 tokens" in err
    assert main(["infer", "--checkpoint", str(out), "--prompt", "the", "--device", "cpu"]) == 2
    assert "pass --index DIR" in capsys.readouterr().err


# ---- refusals: one line, exit 2 ----------------------------------------------------------------------


def refused(argv, capsys, fragment: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tscale-peer: error:"), err
    assert fragment in err, err


def test_a_stale_index_is_refused(corpus, indexed, tmp_path, capsys):
    corpus.write_text(corpus.read_text().replace("cat", "bat"))  # same size, other tokens
    refused(["train", "--data", str(corpus), "--index", str(indexed), "--out", str(tmp_path / "r"), *TINY], capsys,
            "is stale")
    assert not (tmp_path / "r").exists()


def test_an_index_of_another_tokenizer_is_refused(corpus, indexed, tmp_path, capsys):
    tokens = tmp_path / "tokens.bin"
    np.frombuffer(corpus.read_bytes(), dtype=np.uint8).astype("<u2").tofile(tokens)  # the same ids, as a .bin
    refused(["train", "--data", str(tokens), "--index", str(indexed), "--out", str(tmp_path / "r"), *TINY], capsys,
            "built with the byte tokenizer")


def test_an_index_serves_the_tokenizer_it_was_built_with(corpus, tmp_path, capsys):
    bpe = tmp_path / "bpe-index"
    assert main(["index", "build", "--data", str(corpus), "--tokenizer", "bpe:300", "--out", str(bpe)]) == 0
    assert json.loads((bpe / "index.json").read_text())["tokenizer"].startswith("bpe-")
    assert main(["train", "--data", str(corpus), "--tokenizer", "bpe:300", "--index", str(bpe), "--out",
                 str(tmp_path / "r"), "--steps", "2", "--eval-every", "0", *TINY]) == 0
    refused(["train", "--data", str(corpus), "--index", str(bpe), "--out", str(tmp_path / "byte"), *TINY], capsys,
            "is tokenized by byte")


def test_index_build_takes_its_settings_from_a_config_file(corpus, tmp_path):
    config, out = tmp_path / "index.toml", tmp_path / "bpe"
    config.write_text(f'[data]\ndata = "{corpus}"\ntokenizer = "bpe:300"\n[run]\nseed = 3\n[index]\nout = "{out}"\n')
    assert main(["index", "build", "--config", str(config)]) == 0
    assert json.loads((out / "index.json").read_text())["tokenizer"].startswith("bpe-")


@pytest.mark.parametrize("body, flags, fragment", [
    ("[index]\nout = 3\n", [], "key 'out' in config file"),
    ("[data]\nbatch-size = 4\n", ["--out", "x"], "unknown key 'batch-size' in [data]"),  # training's only
    ("[run]\nseed = -1\n", ["--out", "x"], "must not be negative, got -1"),
    ("", ["--seed", "-1", "--out", "x"], "--seed must not be negative, got -1"),
    ("", [], "give --out DIR"),
])
def test_a_bad_index_build_setting_is_one_line(body, flags, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text(body)
    refused(["index", "build", "--config", str(tmp_path / "bad.toml"), *flags], capsys, fragment)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage, fragment", [
    ("truncate", "suffixes.bin holds"),
    ("manifest", "cannot read index.json"),
    ("missing", "answer_tokens.bin is missing"),
    ("nothing", "does not exist"),
])
def test_a_damaged_or_missing_index_is_refused(corpus, indexed, tmp_path, capsys, damage, fragment):
    if damage == "truncate":
        with open(indexed / "suffixes.bin", "r+b") as handle:
            handle.truncate(8)
    elif damage == "manifest":
        (indexed / "index.json").write_text("{not json")
    elif damage == "missing":
        (indexed / "answer_tokens.bin").unlink()
    else:
        shutil.rmtree(indexed)
    refused(["train", "--data", str(corpus), "--index", str(indexed), "--out", str(tmp_path / "r"), *TINY], capsys,
            fragment)


def test_a_checkpoint_and_an_index_must_agree(corpus, indexed, tmp_path, capsys):
    plain = tmp_path / "plain"
    assert main(["train", "--data", str(corpus), "--out", str(plain), "--steps", "2", "--eval-every", "0", *TINY]) == 0
    refused(["train", "--data", str(corpus), "--index", str(indexed), "--out", str(plain), "--resume", "--steps", "4",
             *TINY], capsys, "has no index input")
    refused(["infer", "--checkpoint", str(plain), "--index", str(indexed), "--prompt", "x", "--device", "cpu"], capsys,
            "has no index input")
    refused(["index", "build", "--data", str(corpus), "--out", str(indexed)], capsys, "already exists")
