"""Progress of long work: a rich bar on the terminal by default, a board the dashboard reads when routed there."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tscale_p2p.progress import ProgressBoard, WorkProgress, long_work, showing_progress_on


def test_routed_work_shows_on_the_board_while_it_runs_and_logs_its_last_line(caplog):
    board = ProgressBoard()
    caplog.set_level(logging.INFO, "tscale_p2p.progress")
    with showing_progress_on(board):
        with long_work("downloading the swarm's state", total=800) as work:
            [now] = board.snapshot()
            assert (now.description, now.completed, now.total, now.unit) == ("downloading the swarm's state", 0, 800,
                                                                             "bytes")
            work.advance(300)
            work.update(completed=800, description="downloaded the state of round 3")
            [now] = board.snapshot()
            assert now.completed == 800 and now.description == "downloaded the state of round 3"
    assert board.snapshot() == ()
    assert "downloaded the state of round 3" in caplog.text


def test_quick_work_under_its_delay_shows_nothing_and_transient_work_leaves_no_line(caplog):
    board = ProgressBoard()
    caplog.set_level(logging.INFO, "tscale_p2p.progress")
    with showing_progress_on(board):
        with long_work("tokenizing a tiny file", total=10, delay=60.0) as work:
            work.advance(10)
            assert board.snapshot() == ()
        with long_work("scanning tokens", total=None, unit="items", delay=0.05, transient=True) as work:
            work.advance(5)
            assert board.snapshot() == ()
            time.sleep(0.06)
            work.advance(5)  # the delay has passed: shown from this report on
            assert board.snapshot()[0].completed == 10 and board.snapshot()[0].total is None
    assert board.snapshot() == () and "scanning" not in caplog.text and "tiny" not in caplog.text


def test_work_in_another_thread_reports_to_the_board_and_the_terminal_gets_it_back_after(capsys):
    board = ProgressBoard()
    seen: list[tuple[WorkProgress, ...]] = []
    started, release = threading.Event(), threading.Event()

    def training_thread() -> None:
        with long_work("tokenizing corpus.txt", total=4, unit="items") as work:
            work.advance(1)
            started.set()
            release.wait(10)

    with showing_progress_on(board):
        thread = threading.Thread(target=training_thread)
        thread.start()
        assert started.wait(10)
        seen.append(board.snapshot())
        release.set()
        thread.join()
    assert [w.description for w in seen[0]] == ["tokenizing corpus.txt"]
    assert "tokenizing" not in capsys.readouterr().err  # nothing on the terminal while the dashboard had it

    with long_work("downloading the model", total=2048) as work:  # no dashboard: rich's bar on stderr
        work.update(completed=2048, description="downloaded the model")
    err = capsys.readouterr().err
    assert "downloaded the model" in err and "2.0/2.0 kB" in err
    assert board.snapshot() == ()


def test_a_library_s_own_bar_is_for_the_terminal_only(capsys):
    with long_work("training a BPE", total=10, library_bar=True) as work:
        assert work.on_terminal  # the caller switches the library's bar on; long_work shows nothing itself
        work.advance(10)
    assert capsys.readouterr().err == ""
    board = ProgressBoard()
    with showing_progress_on(board):
        with long_work("training a BPE", total=10, library_bar=True) as work:
            assert not work.on_terminal  # under the dashboard the library's bar stays off: the board shows it
            work.advance(4)
            assert [(w.description, w.completed) for w in board.snapshot()] == [("training a BPE", 4)]


def test_an_unknown_unit_is_a_bug_of_the_caller():
    with pytest.raises(ValueError, match="unit"):
        with long_work("counting", unit="apples"):
            pass


def test_bpe_training_reports_the_bytes_it_has_read_to_the_dashboard(tmp_path):
    from tscale_p2p.data import load_corpus
    from tscale_p2p.tokenizer import train_bpe

    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"word{i % 97} thing{i % 13}" for i in range(4000)))
    reports: list[WorkProgress] = []

    class Recording(ProgressBoard):
        def refresh(self, work) -> None:
            reports.append(work.snapshot())

    with showing_progress_on(Recording()):
        train_bpe(load_corpus(str(text)), 300, cache_dir=tmp_path / "tok")
    assert reports and {r.description for r in reports} == {"training a BPE of 300 tokens"}
    assert 0 < reports[-1].completed == reports[-1].total
