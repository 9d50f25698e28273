"""Byte-level BPE tokenizers (Hugging Face `tokenizers`): training, the token cache, checkpoints, infer, serve,
a two-peer swarm that adopts its founder's tokenizer, and every bad input refused in one line."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from tscale_p2p import tokenizer as tokenizer_module
from tscale_p2p.cli import main
from tscale_p2p.data import load_corpus
from tscale_p2p.errors import UserError
from tscale_p2p.generate import GenerationEngine, load_model
from tscale_p2p.serve import CompletionServer
from tscale_p2p.config import TrainConfig
from tscale_p2p.solo import planned_tokens
from tscale_p2p.tokenizer import (
    DEFAULT_BPE, MAX_DEFAULT_BPE_PASSES, BPETokenizer, _UNICODE_TO_BYTE, apply_tokenizer, default_spec, train_bpe,
)

WORDS = "the swarm trains one model together while every peer keeps its own data and pace".split()
TINY = ["--model", "e32h2d2w64", "--batch-size", "4", "--device", "cpu", "--save-every", "0", "--log-every", "5"]
UNICODE = "naïve café — 日本語 🙂 tabs\tand\r\nnewlines\n\n  spaces  "


@pytest.fixture
def cache(tmp_path) -> Path:
    """Where conftest's autouse fixture points TSCALE_CACHE_DIR."""
    return tmp_path / "cache"


@pytest.fixture
def text_file(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.txt"
    lines = (" ".join(WORDS[i] for i in rng.integers(len(WORDS), size=12)) for _ in range(2500))
    path.write_text("\n".join(lines) + "\n" + UNICODE)
    return path


@pytest.fixture
def source_folder(tmp_path) -> Path:
    """Real files: the project's own modules, and one with non-ASCII text and odd whitespace."""
    folder = tmp_path / "sources"
    folder.mkdir()
    for path in sorted(Path(tokenizer_module.__file__).parent.glob("*.py")):
        (folder / path.name).write_text(path.read_text())
    (folder / "unicode.txt").write_text(UNICODE * 50)
    return folder


def test_the_byte_level_alphabet_is_the_librarys():
    assert set(_UNICODE_TO_BYTE) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_UNICODE_TO_BYTE.values()) == list(range(256))


def test_a_trained_bpe_round_trips_real_files_and_its_token_cache_decodes_to_the_source(source_folder, cache):
    corpus = load_corpus(str(source_folder))
    bpe = apply_tokenizer(corpus, "bpe:400", seed=0)
    tokenizer = bpe.tokenizer
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == bpe.vocab_size == 400
    for text in (*(p.read_text() for p in sorted(source_folder.iterdir())), UNICODE, "", " x"):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert len(ids) < len(text.encode()) or len(text) < 3  # it merges
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    # The memory-mapped cache holds uint16 ids that decode to exactly the split's source bytes.
    assert bpe.train.tokens.dtype == np.uint16
    for split in ("train", "val"):
        source = bytes(corpus.stream(split).tokens)
        assert tokenizer.decode(bpe.stream(split).tokens).encode() == source
    assert bpe.bytes_per_token == pytest.approx(len(corpus.val) / len(bpe.val))
    assert bpe.bits_per_byte(2.0) == pytest.approx(2.0 / np.log(2) / bpe.bytes_per_token)
    # Loading again reuses the cache: same files, nothing retrained.
    before = sorted(p.name for p in (cache / "data").iterdir())
    again = apply_tokenizer(load_corpus(str(source_folder)), "bpe:400", seed=0)
    assert again.tokenizer.sha256 == tokenizer.sha256 and np.array_equal(again.train.tokens, bpe.train.tokens)
    assert sorted(p.name for p in (cache / "data").iterdir()) == before


def test_training_is_deterministic_for_a_corpus_and_seed_and_the_seed_picks_the_sample(source_folder, tmp_path,
                                                                                      monkeypatch):
    corpus = load_corpus(str(source_folder))
    first = train_bpe(corpus, 300, seed=0, cache_dir=tmp_path / "a")
    second = train_bpe(corpus, 300, seed=0, cache_dir=tmp_path / "b")  # trained again, not read from a's cache
    assert first.json_text == second.json_text
    # A corpus beyond the sample bound: learnt from seeded pieces of it.
    monkeypatch.setattr(tokenizer_module, "_SAMPLE_PIECE_BYTES", 4096)
    monkeypatch.setattr(tokenizer_module, "TRAIN_SAMPLE_BYTES", 3 * 4096)
    trained = [train_bpe(corpus, 300, seed=seed, cache_dir=tmp_path / f"{i}").sha256 for i, seed in enumerate((0, 0, 1))]
    assert trained[0] == trained[1] != trained[2] != first.sha256


def test_a_checkpoint_carries_its_tokenizer_resumes_with_it_and_refuses_another(text_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--data", str(text_file), "--out", str(out), *TINY]
    assert main([*args, "--tokenizer", "bpe:300", "--steps", "4"]) == 0
    saved = out / "step-00000004"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["meta"]["tokenizer"]["kind"] == "bpe" and "tokenizer.json" in meta["files"]
    assert meta["model_config"]["vocab_size"] == 300
    # No --tokenizer: the checkpoint's (not the byte default).
    assert main([*args, "--steps", "6", "--resume"]) == 0
    assert json.loads((out / "step-00000006" / "meta.json").read_text())["meta"]["tokenizer"] == \
        meta["meta"]["tokenizer"]
    capsys.readouterr()
    for other in ("byte", "bpe:320"):
        assert main([*args, "--steps", "8", "--resume", "--tokenizer", other]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--tokenizer {other}" in err and "checkpoint's model was trained with" in err
        assert "BPE tokenizer (300 tokens" in err
    # A replaced tokenizer.json (manifest and all) is caught by its hash in the checkpoint's meta.
    (saved / "tokenizer.json").write_text((saved / "tokenizer.json").read_text() + "\n")
    with pytest.raises(UserError, match="tokenizer.json"):
        load_model(saved, device="cpu")


def test_the_default_is_bpe_unless_the_run_passes_over_its_data_many_times(text_file, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(text_file.read_text() * 3)  # ~570 KB: over the 256 KiB a default BPE needs
    corpus = load_corpus(str(big))
    split = len(corpus.train)
    assert default_spec(corpus, planned_tokens=split) == DEFAULT_BPE  # ~3.4 passes in BPE tokens
    assert default_spec(corpus, planned_tokens=split * MAX_DEFAULT_BPE_PASSES) == "byte"  # ~54 passes
    assert default_spec(corpus, planned_tokens=None) == "byte"
    assert default_spec(load_corpus(str(text_file)), planned_tokens=1000) == "byte"  # ~190 KB: too small
    # The budget is the run's: steps x batch x accumulation x context (the model's when --context is not given).
    cfg = TrainConfig(data=str(big), model="e32h2d2w64", steps=10, batch_size=4, grad_accum=2)
    assert planned_tokens(cfg, "cpu") == 10 * 4 * 2 * 64
    assert planned_tokens(TrainConfig(data=str(big), steps=10, index=str(tmp_path / "idx")), "cpu") is None
    # `train` with no --tokenizer trains on the default BPE, and its checkpoint carries it.
    out = tmp_path / "run"
    assert main(["train", "--data", str(big), "--out", str(out), *TINY, "--steps", "2"]) == 0
    meta = json.loads((out / "step-00000002" / "meta.json").read_text())
    assert meta["meta"]["tokenizer"]["kind"] == "bpe" and meta["model_config"]["vocab_size"] > 256


@pytest.fixture
def bpe_run(text_file, tmp_path) -> Path:
    """A tiny model trained on the repetitive word corpus with a BPE, long enough to speak its words."""
    out = tmp_path / "bpe-run"
    assert main(["train", "--data", str(text_file), "--out", str(out), "--tokenizer", "bpe:320", "--steps", "40",
                 "--lr", "2e-2", "--warmup", "5", *TINY]) == 0
    return out


def test_infer_and_serve_speak_the_models_tokenizer(bpe_run, capsys):
    capsys.readouterr()
    assert main(["infer", "--checkpoint", str(bpe_run), "--prompt", "the swarm", "--max-tokens", "24",
                 "--temperature", "0", "--device", "cpu", "--no-compile"]) == 0
    captured = capsys.readouterr()
    words = captured.out.split()
    # Decoded through the BPE's bytes: whole words of the corpus (bytes read as ids would be gibberish).
    assert len(words) >= 5 and sum(w in WORDS for w in words) >= len(words) - 1, captured.out
    model, _ = load_model(bpe_run, device="cpu")
    prompt_tokens = len(model.tokenizer.encode("the swarm"))
    assert prompt_tokens < len("the swarm") and f"prompt {prompt_tokens} tokens" in captured.err
    server = CompletionServer(GenerationEngine(model, slots=2), "bpe", "127.0.0.1", 0)
    server.start()
    try:
        connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
        prompt = "every peer keeps its own"
        connection.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 6,
                                                                 "temperature": 0}).encode(),
                           {"Content-Type": "application/json"})
        reply = json.loads(connection.getresponse().read())
        connection.close()
    finally:
        server.close()
    assert reply["usage"]["prompt_tokens"] == len(model.tokenizer.encode(prompt)) < len(prompt)
    assert reply["usage"]["completion_tokens"] == 6
    assert set(reply["choices"][0]["text"].split()) <= set(WORDS)


def test_a_bin_names_its_tokenizer_and_becomes_decodable(text_file, tmp_path, capsys):
    corpus = load_corpus(str(text_file))
    tokenizer = train_bpe(corpus, 300, cache_dir=tmp_path / "tok")
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_text(tokenizer.json_text)
    data = tmp_path / "train.bin"
    np.asarray(tokenizer.encode(text_file.read_text()), dtype="<u2").tofile(data)
    out = tmp_path / "bin-run"
    capsys.readouterr()
    assert main(["train", "--data", str(data), "--tokenizer", str(tokenizer_json), "--out", str(out), "--steps", "3",
                 *TINY]) == 0
    model, _ = load_model(out, device="cpu")
    assert model.tokenizer.sha256 == tokenizer.sha256
    # Without --tokenizer the .bin stays undecodable: its checkpoint says so, and infer refuses in one line.
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "bare"), "--steps", "2", *TINY]) == 0
    capsys.readouterr()
    assert main(["infer", "--checkpoint", str(tmp_path / "bare"), "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown tokenizer" in err


def write_wordpiece(path: Path) -> None:
    HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(path))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--tokenizer", "bpe:256"], "vocabulary 256 is too small"),
        (["--tokenizer", "bpe:many"], "VOCAB must be an integer"),
        (["--tokenizer", f"bpe:{2**32 + 1}"], "too large for uint32 ids"),
        (["--tokenizer", "missing.json"], "'missing.json': no such file"),
        (["--tokenizer", "garbage.json"], "not a tokenizer.json of the tokenizers library"),
        (["--tokenizer", "wordpiece.json"], "not ByteLevel"),
        (["--tokenizer", "small.json"], "a vocabulary of 2 ids"),
        (["--data", "ids.bin", "--tokenizer", "bpe:300"], "already tokenized by another tokenizer"),
        (["--data", "ids.bin", "--tokenizer", "byte"], "already tokenized by another tokenizer"),
        (["--data", "ids.bin", "--tokenizer", "tokenizer.json"], "holds token id 4000, beyond the vocabulary"),
    ],
)
def test_bad_tokenizers_are_refused_in_one_line(flags, fragment, text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.json").write_text("{not json")
    write_wordpiece(tmp_path / "wordpiece.json")
    small = json.loads(train_bpe(load_corpus(str(text_file)), 300, cache_dir=tmp_path / "t").json_text)
    (tmp_path / "tokenizer.json").write_text(json.dumps(small))
    small["decoder"], small["model"]["vocab"], small["model"]["merges"] = small["decoder"], {"a": 0, "b": 1}, []
    (tmp_path / "small.json").write_text(json.dumps(small))
    np.array([1, 2, 4000, 5] * 100, dtype="<u2").tofile(tmp_path / "ids.bin")
    args = ["train", "--data", str(text_file), "--out", str(tmp_path / "out"), "--steps", "1", *TINY, *flags]
    if "--data" in flags:
        args = ["train", "--out", str(tmp_path / "out"), "--steps", "1", *TINY, *flags]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_joiner_adopts_the_founders_tokenizer_and_both_train(text_file, tmp_path, capsys):
    from test_swarm import FAST_ROUNDS, Process, join_args, join_flags, rounds

    started: list[Process] = []
    try:
        founder_args = join_args("a", text_file, "--run-id", "bpe", "--tokenizer", "bpe:300", "--steps", "1000000",
                                 *TINY, *FAST_ROUNDS)
        started.append(Process(founder_args, tmp_path / "a.log", tmp_path))
        a = started[0]
        founder = a.wait_for(r"tscale-peer join --initial-peers (\S+) --run-id bpe", timeout=90)[0].group(1)
        # The joiner trains until the test stops it: one done with its steps reads as idle to the founder, which then
        # gives its rounds up after two matchmaking windows, and a give-up that raced the joiner's last group left
        # the joiner averaged and the founder alone (--max-steps 60: seen in CI).
        joiner_args = join_args("b", text_file, "--initial-peers", founder, "--run-id", "bpe")
        started.append(Process(joiner_args, tmp_path / "b.log", tmp_path))
        b = started[1]
        b.wait_for(r"fetching the tokenizer of run 'bpe' from a live peer", timeout=60)
        b.wait_for(r"round \d+: averaged with 1 peer", timeout=90)
        assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer.json").read_bytes()
        assert "BPE tokenizer (300 tokens" in b.output()
        # The founder logs the same round once its own side of it ends, which may be after the joiner's line.
        a.wait_for(r"round \d+: averaged with 1 peer", timeout=60)
        assert any(others == 1 for others, _ in rounds(a.output()).values())
        # A joiner whose --tokenizer is not the run's is refused, naming both.
        capsys.readouterr()
        refused = join_flags(str(tmp_path / "c"), text_file, "--initial-peers", founder, "--run-id", "bpe",
                             "--tokenizer", "byte")
        assert main(refused) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--tokenizer byte (the byte tokenizer) differs from run 'bpe'" in err
        assert "BPE tokenizer (300 tokens, sha256" in err
        # infer --initial-peers decodes with the run's tokenizer.
        assert main(["infer", "--initial-peers", founder, "--run-id", "bpe", "--prompt", "the", "--max-tokens",
                     "8", "--device", "cpu", "--no-compile", "--seed", "0"]) == 0
        assert re.search(r"\[8 tokens,", capsys.readouterr().err)
    finally:
        for process in started:
            process.signal_group(9)
            process.popen.wait(10)
