"""The dashboard: pilot tests with a fake metrics source, snapshots at 80x24 and 160x48, a live swarm."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
import time
from dataclasses import replace

import pytest

from test_swarm import MADDR, TINY, join_args, spawn, text_file  # noqa: F401 - spawn, text_file: fixtures
from tscale_p2p.config import TrainConfig
from tscale_p2p.peers.join import JoinOptions, join
from tscale_p2p.peers.metrics import PeerRecord
from tscale_p2p.peers.network import NetworkOptions
from tscale_p2p.peers.settings import SwarmSettings
from tscale_p2p.peers.status import AveragingRecord, LocalStatus, StatusSnapshot
from tscale_p2p.peers.swarm_state import saved_state_file
from tscale_p2p.progress import WorkProgress
from tscale_p2p.tui import format as fmt
from tscale_p2p.tui.app import Dashboard, PeersFetched, logging_into
from tscale_p2p.tui.help import HelpScreen
from tscale_p2p.tui.log_pane import LogPane
from tscale_p2p.tui.peers_table import PeersTable
from tscale_p2p.tui.source import MetricsSource, SwarmWatchSource, TrainingPeerSource
from tscale_p2p.tui.work_progress import WorkProgressLine
from tscale_p2p.tui.summary import SwarmTotals

pytestmark = pytest.mark.timeout(60)

NOW = 1_780_000_000.0  # fixed wall clock: "last seen" ages are the same on every run
SELF_ID = "12D3KooWSelfSelfSelfSelfSelfSelfSelfSelfSelfSe1fPe"


def peer(peer_id: str, name: str, **values) -> PeerRecord:
    defaults = dict(
        device="NVIDIA H200", precision="fp8", offload=False, tokens_per_s=50_000.0, loss=2.5, round=41,
        step=8200, tokens_contributed=400_000_000, bytes_sent=3_000_000_000, bytes_received=2_900_000_000,
        last_averaging=NOW - 30, version="0.1.0", relayed=False, updated_at=NOW - 2,
    )  # fmt: skip
    return PeerRecord(peer_id=peer_id, name=name, **{**defaults, **values})


PEERS = [
    peer(SELF_ID, "lab-h200", tokens_per_s=61_234.0, loss=2.413, round=42, tokens_contributed=512_000_000),
    peer("12D3KooWAliceAliceAliceAliceAliceAliceAliceAlice4x", "alice", device="NVIDIA GeForce RTX 4090",
         precision="int8", tokens_per_s=18_900.0, loss=2.471, tokens_contributed=150_000_000, updated_at=NOW - 5),
    peer("12D3KooWBobBobBobBobBobBobBobBobBobBobBobBobBob9q", "bob-laptop", device="cpu", precision="fp32",
         tokens_per_s=812.0, loss=2.902, round=40, tokens_contributed=3_100_000, relayed=True, updated_at=NOW - 47),
    peer("12D3KooWCarolCarolCarolCarolCarolCarolCarolCaro7z", "carol-a100-spot", device="NVIDIA A100-SXM4-80GB",
         precision="bf16", offload=True, tokens_per_s=33_000.0, loss=None, round=0, step=0, tokens_contributed=0,
         updated_at=NOW - 0.4),
]  # fmt: skip

AVERAGING = tuple(
    AveragingRecord(round=r, group_size=4 - (r % 5 == 0), bytes_up=1_120_000 + 997 * r, bytes_down=1_090_000 + 13 * r,
                    duration_s=2.0 + (r % 3) * 0.7, bits_per_param=1.60 - 0.18 * (r % 5 == 0), bits_per_value=1.07,
                    dropped_peers=int(r % 5 == 0),
                    finished_at=NOW - 60 * (42 - r))
    for r in range(30, 43)
)  # fmt: skip

LOG_LINES = (
    "05:01:02 INFO joined run demo as lab-h200 (12D3KooWSelf…1fPe)",
    "05:01:09 INFO downloaded state from …ice4x: 125M params in 4.1s",
    "05:03:40 WARNING averaging round 40: peer …rol7z timed out, continuing without it",
    "05:04:12 ERROR rejected update from …Bob9q: non-finite values",
    "05:05:00 INFO round 42 averaged with 4 peers in 2.0s",
)


class FakeSource(MetricsSource):
    """Fixed data that advances one training step per `local()` call, and records what the UI asked."""

    def __init__(self, training: bool = True, peers: list[PeerRecord] = PEERS) -> None:
        self.run_id, self.model = "demo", "e768h12d12w1024"
        self.training = training
        self.peers = peers
        self.calls = 0
        self.fetches = 0
        self.paused = threading.Event()
        self.stop_requested = False
        self.done = False

    def local(self) -> StatusSnapshot | None:
        if not self.training:
            return None
        self.calls += 1
        i = self.calls
        return StatusSnapshot(
            peer_id=SELF_ID, name="lab-h200", run_id="demo", device="NVIDIA H200", step=8200 + 10 * i,
            max_steps=20_000, loss=2.9 - 0.5 * (1 - math.exp(-i / 15)) + 0.03 * math.sin(i),
            tokens_per_s=60_000.0 + 2_500 * math.sin(i / 3), tokens_contributed=512_000_000,
            gpu_memory_bytes=41_300_000_000, precision="fp8", offload=False, round=42, inner_steps=500,
            seconds_to_next_averaging=37.5, averaging_in_flight=False,
            paused=self.paused.is_set(), averaging=AVERAGING, log_lines=LOG_LINES, updated_at=NOW,
        )  # fmt: skip

    def fetch_peers(self) -> list[PeerRecord]:
        self.fetches += 1
        wobble = 1 + 0.05 * math.sin(self.fetches - 1)  # the same for every peer: the order stays
        return [replace(p, tokens_per_s=p.tokens_per_s * wobble) for p in self.peers]

    def log_lines(self):
        return LOG_LINES

    def set_paused(self, paused: bool) -> None:
        (self.paused.set if paused else self.paused.clear)()

    def request_stop(self) -> None:
        self.stop_requested = True

    def finished(self) -> bool:
        return self.done

    def now(self) -> float:
        return NOW


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


def quiet_dashboard(source: MetricsSource) -> Dashboard:
    """A dashboard whose timers never fire during a test: the test drives every refresh itself."""
    return Dashboard(source, local_interval_s=3600, swarm_interval_s=3600)


async def settle(pilot, local_refreshes: int = 0, swarm_refreshes: int = 0) -> None:
    """Wait for the first peer fetch to be shown, then take more local and swarm samples, in order."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    for _ in range(swarm_refreshes):
        pilot.app.refresh_swarm()
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
    for _ in range(local_refreshes):
        pilot.app.refresh_local()
    await pilot.pause()


def row_names(table: PeersTable) -> list[str]:
    return [table.get_row(row.key)[1].plain for row in table.ordered_rows]


@pytest.mark.anyio
async def test_pause_key_pauses_and_resumes_local_training():
    source = FakeSource()
    app = quiet_dashboard(source)
    async with app.run_test() as pilot:
        await settle(pilot)
        assert app.active_bindings["p"].binding.description == "Pause"
        await pilot.press("p")
        assert source.paused.is_set()
        assert app.query_one("#local").has_class("-paused")
        assert "paused" in app.query_one("#local").border_title
        assert app.active_bindings["p"].binding.description == "Resume"
        await pilot.press("p")
        assert not source.paused.is_set()
        assert not app.query_one("#local").has_class("-paused")


@pytest.mark.parametrize("key", ["q", "ctrl+c"])
@pytest.mark.anyio
async def test_quit_asks_the_peer_to_checkpoint_and_leave(key):
    source = FakeSource()
    app = quiet_dashboard(source)
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press(key)
        await pilot.pause()
        assert source.stop_requested
    assert app.return_code == 0


@pytest.mark.anyio
async def test_dashboard_closes_when_training_ends_on_its_own():
    source = FakeSource()
    app = quiet_dashboard(source)
    async with app.run_test() as pilot:
        await settle(pilot)
        source.done = True
        app.refresh_local()
        await pilot.pause()
        assert not app.is_running
    assert not source.stop_requested


@pytest.mark.anyio
async def test_peers_sort_by_tokens_per_s_then_by_key_and_header_click():
    app = quiet_dashboard(FakeSource())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        table = app.query_one(PeersTable)
        assert row_names(table) == ["lab-h200", "carol-a10…", "alice", "bob-laptop"]  # tokens/s, highest first
        await pilot.press("s")  # next column: tokens contributed, highest first
        assert table.sort_column == "tokens" and table.sort_reverse
        assert row_names(table) == ["lab-h200", "alice", "bob-laptop", "carol-a10…"]
        # Clicking a header sorts by it (loss: lowest first, peers without a loss last); again reverses.
        loss_x = sum(c.get_render_width(table) for c in table.ordered_columns[: table.get_column_index("loss")])
        await pilot.click(PeersTable, offset=(loss_x + 2, 1))
        assert table.sort_column == "loss" and not table.sort_reverse
        assert row_names(table) == ["lab-h200", "alice", "bob-laptop", "carol-a10…"]
        assert str(table.ordered_columns[table.get_column_index("loss")].label) == "loss▲"
        await pilot.click(PeersTable, offset=(loss_x + 2, 1))
        assert row_names(table) == ["carol-a10…", "bob-laptop", "alice", "lab-h200"]
        # The order survives the next refresh of the records.
        app.post_message(PeersFetched(list(reversed(PEERS))))
        await pilot.pause()
        assert row_names(table) == ["carol-a10…", "bob-laptop", "alice", "lab-h200"]


@pytest.mark.anyio
async def test_this_peer_is_highlighted_and_rows_show_the_record_fields():
    app = quiet_dashboard(FakeSource())
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        table = app.query_one(PeersTable)
        own, alice, bob = (table.get_row(p.peer_id) for p in (PEERS[0], PEERS[1], PEERS[2]))
        assert own[0].style and own[0].style == own[-1].style
        assert not alice[0].style
        assert bob[0].style and bob[0].style != own[0].style  # last seen 47 s ago: greyed
        assert [cell.plain for cell in bob] == ["…Bob9q", "bob-laptop", "relay", "cpu fp32", "812", "3.1M", "2.902", "40", "47s"]
        assert app.query_one("#peers").border_title == "peers · 4 online"


@pytest.mark.anyio
async def test_numbers_that_are_not_finite_show_as_dashes():
    """A record's cells never take the dashboard down (and the `join` it runs with): whatever a record holds is
    drawn, a number that is not finite as a dash."""
    odd = peer("12D3KooWOddOddOddOddOddOddOddOddOddOddOddOddOdd7q", "odd", tokens_per_s=math.inf, loss=math.nan,
               bytes_sent=2**63 - 1, updated_at=math.nan)
    app = quiet_dashboard(FakeSource(peers=[*PEERS, odd]))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        cells = {column.key: cell.plain for column, cell in
                 zip(app.query_one(PeersTable).columns_shown, app.query_one(PeersTable).get_row(odd.peer_id))}
        assert cells["tokens_per_s"] == cells["loss"] == cells["seen"] == "-"
        assert cells["sent"] == "9.2e+18B"  # past the largest suffix, still short


@pytest.mark.anyio
async def test_wide_terminal_shows_every_record_field():
    app = quiet_dashboard(FakeSource())
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        table = app.query_one(PeersTable)
        carol = [cell.plain for cell in table.get_row(PEERS[3].peer_id)]
        assert carol == ["…aro7z", "carol-a100-spot", "direct", "A100-SXM4-8…", "bf16", "cpu", "33k", "0", "-",
                         "0", "0", "3GB", "2.9GB", "0", "0.1.0", "now"]  # fmt: skip


@pytest.mark.anyio
async def test_help_screen_opens_and_closes():
    app = quiet_dashboard(FakeSource())
    async with app.run_test() as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        assert "Help" in [b.binding.description for b in app.active_bindings.values() if b.binding.show]


@pytest.mark.anyio
async def test_watching_without_training_hides_local_panels_and_cannot_pause():
    source = FakeSource(training=False)
    app = quiet_dashboard(source)
    async with app.run_test() as pilot:
        await settle(pilot)
        assert not app.query_one("#local").display and not app.query_one("#averaging").display
        assert "p" not in app.active_bindings or not app.active_bindings["p"].enabled
        await pilot.press("p")
        assert not source.paused.is_set()
        assert app.query_one(PeersTable).row_count == len(PEERS)


class SlowSwarm(FakeSource):
    """A DHT that answers only when the test lets it: the screen must stay live meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()

    def fetch_peers(self) -> list[PeerRecord]:
        assert self.answer.wait(timeout=10)
        return super().fetch_peers()


@pytest.mark.anyio
async def test_a_slow_swarm_never_freezes_the_screen():
    source = SlowSwarm()
    app = quiet_dashboard(source)
    async with app.run_test() as pilot:
        await pilot.pause()
        assert app.query_one(PeersTable).row_count == 0
        await pilot.press("p")  # handled while the fetch is still blocked in its worker thread
        assert source.paused.is_set() and app.query_one("#local").has_class("-paused")
        source.answer.set()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.query_one(PeersTable).row_count == len(PEERS)


class BrokenSwarm(FakeSource):
    def fetch_peers(self) -> list[PeerRecord]:
        raise TimeoutError("no DHT node answered")


@pytest.mark.anyio
async def test_a_failing_swarm_fetch_is_logged_and_the_dashboard_carries_on(caplog):
    app = quiet_dashboard(BrokenSwarm())
    async with app.run_test() as pilot:
        await settle(pilot, local_refreshes=1)
        assert app.is_running
        assert "could not read peer records: no DHT node answered" in caplog.text
        # the local peer still counts, with its live figures
        assert "1 peer ·" in str(app.query_one("#summary").render())


def test_logging_goes_to_the_pane_not_the_terminal_while_the_dashboard_runs():
    root = logging.getLogger()
    terminal = logging.StreamHandler(sys.stderr)
    root.addHandler(terminal)
    source = SwarmWatchSource("demo", ["/ip4/127.0.0.1/tcp/9/p2p/QmNotConnected"])  # keeps its own lines; never connects here
    try:
        with logging_into(source):
            assert terminal not in root.handlers
            logging.getLogger("hivemind.test").warning("peer …Bob9q sent NaN")
        assert terminal in root.handlers
        logging.getLogger("hivemind.test").warning("after the dashboard closed")
    finally:
        root.removeHandler(terminal)
    lines = source.log_lines()
    assert len(lines) == 1 and " WARN" in lines[0] and "peer …Bob9q sent NaN" in lines[0]


def test_a_training_peer_s_pane_takes_other_libraries_lines_once():
    status = LocalStatus()
    handler = TrainingPeerSource(status).log_handler()
    for name in ("hivemind.averaging", "tscale_p2p.peers.swarm"):
        handler.handle(logging.LogRecord(name, logging.WARNING, __file__, 1, f"from {name}", None, None))
    # `join` copies tscale_p2p's own records into LocalStatus itself; the dashboard adds the rest.
    assert [line.split(" ", 2)[2] for line in status.snapshot().log_lines] == ["from hivemind.averaging"]


def test_a_training_peer_s_dashboard_shows_the_records_its_peer_read():
    status = LocalStatus()
    source = TrainingPeerSource(status)
    assert source.fetch_peers() == [] and source.model == ""  # the peer's DHT is not up yet
    records = (peer("12D3KooWAlpha", "alpha"), peer("12D3KooWBeta", "beta"))
    status.update(run_id="live", model="e32h2d2w64", swarm_records=records)
    assert source.fetch_peers() == list(records)
    assert (source.run_id, source.model) == ("live", "e32h2d2w64")


def snapshot_run_before(local_refreshes: int):
    async def run_before(pilot) -> None:
        await settle(pilot, local_refreshes, swarm_refreshes=12)

    return run_before


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_snapshot_training_peer(snap_compare, size):
    assert snap_compare(quiet_dashboard(FakeSource()), terminal_size=size, run_before=snapshot_run_before(60))


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_snapshot_watching_only(snap_compare, size):
    assert snap_compare(quiet_dashboard(FakeSource(training=False)), terminal_size=size, run_before=snapshot_run_before(0))


class BusySource(FakeSource):
    """A peer still downloading the swarm's state (fixed figures: the snapshot never changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.works = [WorkProgress("downloading the swarm's state", 9_400_000, 26_200_000, "bytes", 3.2)]

    def long_work(self):
        return tuple(self.works)


@pytest.mark.anyio
async def test_long_work_shows_in_the_progress_line_and_the_line_goes_when_it_ends():
    source = BusySource()
    app = quiet_dashboard(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, local_refreshes=1)
        line = app.query_one(WorkProgressLine)
        assert line.display and line.region.height == 1
        assert str(line.query_one("#work-description").render()) == "downloading the swarm's state"
        assert str(line.query_one("#work-amount").render()) == "9.4MB/26.2MB · 3.2s"
        source.works.append(WorkProgress("tokenizing corpus.txt", 10, None, "items", 0.5))
        app.refresh_local()
        await pilot.pause()
        assert str(line.query_one("#work-description").render()) == "downloading the swarm's state (+1 more)"
        source.works.clear()
        app.refresh_local()
        await pilot.pause()
        assert not line.display
        assert line.region.height == 0


def test_snapshot_downloading_state_80x24(snap_compare):
    assert snap_compare(quiet_dashboard(BusySource()), terminal_size=(80, 24), run_before=snapshot_run_before(5))


def test_snapshot_paused_80x24(snap_compare):
    async def run_before(pilot) -> None:
        await settle(pilot, 30)
        await pilot.press("p")

    assert snap_compare(quiet_dashboard(FakeSource()), terminal_size=(80, 24), run_before=run_before)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_live_two_peer_swarm_appears_in_the_table_and_q_stops_this_peer(spawn, tmp_path, text_file):
    """Peer "alpha" trains in this process through `join` with a `LocalStatus`; a child process joins as
    "beta". The real dashboard (headless, in a thread: hivemind starts its averager only from the main
    thread) shows both from the records alpha reads from the DHT; a watch-only source of its own finds both
    too; then `q` makes alpha save a checkpoint and leave."""
    status = LocalStatus()
    cfg = TrainConfig(data=str(text_file), model="e32h2d2w64", batch_size=4, device="cpu", log_every=5,
                      steps=1_000_000, save_every=0, out=str(tmp_path / "alpha"))  # fmt: skip (both train until q)
    network = NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",), identity_path=str(tmp_path / "alpha.key"))
    swarm = SwarmSettings(name="alpha", inner_steps=5, matchmaking_time=2, averaging_timeout=10)
    options = JoinOptions(network, run_id="live", swarm=swarm)
    source = TrainingPeerSource(status)
    seen: dict[str, object] = {}

    async def watch() -> None:
        # Wait until alpha trains, not just until its DHT is up: alpha's main thread then forks its averager
        # process, and a fork that lands inside this thread's `Popen` inherits the pipe through which Popen
        # waits for beta's exec, so Popen would block until alpha's averager exits (seen: 1 run in 4).
        deadline = time.monotonic() + 60
        while status.snapshot().step == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        (alpha_maddr,) = [m for m in status.snapshot().visible_maddrs if MADDR.fullmatch(m)]
        spawn("beta", *join_args("beta", text_file, "--initial-peers", alpha_maddr, "--run-id", "live",
                                 "--name", "beta", *TINY))  # fmt: skip
        app = Dashboard(source, local_interval_s=0.5, swarm_interval_s=1.0)
        async with app.run_test(size=(120, 30)) as pilot:
            table = app.query_one(PeersTable)
            deadline = time.monotonic() + 90
            while sorted(row_names(table)) != ["alpha", "beta"] and time.monotonic() < deadline:
                await pilot.pause(0.5)
            seen["names"] = sorted(row_names(table))
            seen["own row style"] = table.get_row(status.snapshot().peer_id)[0].style
            seen["summary"] = str(app.query_one("#summary").render())
            seen["log"] = app.query_one(LogPane).lines
            # What `tscale-peer dashboard --initial-peers ALPHA` sees, from a node of its own:
            watcher = SwarmWatchSource("live", [alpha_maddr])
            try:
                seen["watched"] = sorted(r.name for r in await asyncio.to_thread(watcher.fetch_peers))
            finally:
                watcher.close()
            await pilot.press("q")

    def dashboard_thread() -> None:
        try:
            asyncio.run(watch())
        finally:
            status.stop_requested.set()  # whatever happened, let alpha leave

    watcher = threading.Thread(target=dashboard_thread)
    watcher.start()
    try:
        code = join(cfg, {}, options, status)
    finally:
        status.stop_requested.set()
        watcher.join(timeout=120)
    assert seen.get("names") == ["alpha", "beta"], seen
    assert seen["own row style"]  # alpha's own row is highlighted
    assert "e32h2d2w64" in seen["summary"] and "2 peers" in seen["summary"]
    assert seen["watched"] == ["alpha", "beta"]
    assert code == 0
    assert saved_state_file(tmp_path / "alpha") is not None, "alpha saved no checkpoint after q"


@pytest.mark.anyio
async def test_a_refresh_keeps_the_reader_s_place_in_a_long_peers_table():
    crowd = [peer(f"12D3KooWCrowd{i:036d}", f"volunteer-{i:02d}", tokens_per_s=1000.0 + i) for i in range(40)]
    app = quiet_dashboard(FakeSource(peers=crowd))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        table = app.query_one(PeersTable)
        table.scroll_to(y=20, animate=False, immediate=True)
        await pilot.pause()
        assert table.scroll_y == 20
        app.post_message(PeersFetched(crowd))
        await pilot.pause()
        await pilot.pause()
        assert table.row_count == 40 and table.scroll_y == 20


def test_short_numbers_for_narrow_cells():
    assert [fmt.count(n) for n in (0, 812, 999.6, 18_900, 999_999, 4_560_000, 123_000_000)] == [
        "0", "812", "1k", "18.9k", "1M", "4.56M", "123M"
    ]  # fmt: skip
    assert fmt.size(1_160_000) == "1.16MB"
    assert [fmt.duration(s) for s in (0.4, 12, 185, 7800)] == ["0.4s", "12s", "3m05s", "2h10m"]
    assert [fmt.age(s) for s in (0.3, 47, 300, 3 * 3600, 3 * 86400)] == ["now", "47s", "5m", "3h", "3d"]
    assert fmt.loss(None) == "-" and fmt.loss(float("nan")) == "-" and fmt.loss(2.4129) == "2.413"


def test_a_silent_peer_stops_counting_in_the_swarms_tokens_per_s_but_stays_listed():
    """A killed peer's record lives until its TTL (a minute); its tokens/s must not count for all that time."""
    fresh, silent = PEERS[1], replace(PEERS[2], updated_at=NOW - 16)  # 3 missed publications and more
    totals = SwarmTotals.of([fresh, silent], None, NOW)
    assert totals.peers == 2 and totals.tokens_per_s == fresh.tokens_per_s
    assert totals.tokens == fresh.tokens_contributed + silent.tokens_contributed  # what it trained still counts
    assert SwarmTotals.of([fresh, silent], None, NOW - 10).tokens_per_s == fresh.tokens_per_s + silent.tokens_per_s
