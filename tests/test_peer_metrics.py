"""LocalStatus (the dashboard's view of this peer) and signed PeerRecords in a real hivemind DHT."""

from __future__ import annotations

import io
import json
import re
import logging
import threading
import time

import pytest
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from fake_peers import fake_record, fast_rsa_key, flood
from tscale_p2p.cli import main
from tscale_p2p.cli.swarm import PEER_COLUMNS, print_peer_table
from tscale_p2p.errors import UserError
from tscale_p2p.peers import metrics as metrics_module
from tscale_p2p.peers.metrics import MAX_NAME_CHARS, PeerRecord, SwarmMetrics, check_public_name, peer_records_key
from tscale_p2p.peers.status import AveragingRecord, LocalStatus

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def make_record(peer_id: str, name: str, **changes) -> PeerRecord:
    values = dict(
        peer_id=peer_id, name=name, device="cpu", precision="fp32", offload=False, tokens_per_s=1234.5,
        loss=2.5, round=3, step=120, tokens_contributed=40960, bytes_sent=1000, bytes_received=900,
        last_averaging=time.time(), version="0.1.0", relayed=False, updated_at=time.time(),
    )
    return PeerRecord(**{**values, **changes})


def test_status_snapshot_is_a_consistent_copy_under_concurrent_updates():
    status = LocalStatus(averaging_history=3, log_history=2)
    stop = threading.Event()

    def writer():
        step = 0
        while not stop.is_set():
            step += 1
            status.update(step=step, tokens_contributed=step * 10)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(200):
            snap = status.snapshot()
            assert snap.tokens_contributed == snap.step * 10
    finally:
        stop.set()
        thread.join()
    for number in range(5):
        status.record_averaging(AveragingRecord(number, 2, 10, 10, 0.5, 1.03, 0))
    status.paused.set()
    snap = status.snapshot()
    assert [r.round for r in snap.averaging] == [2, 3, 4]
    assert snap.paused and not snap.stop_requested
    with pytest.raises(TypeError, match="no field"):
        status.update(stepz=1)


def test_status_log_handler_keeps_the_newest_lines():
    status = LocalStatus(log_history=2)
    logger = logging.getLogger("test_status_log_handler")
    logger.addHandler(status.log_handler())
    logger.setLevel(logging.INFO)
    for number in range(3):
        logger.info("line %d", number)
    lines = status.snapshot().log_lines
    assert len(lines) == 2 and lines[0].endswith("line 1") and lines[1].endswith("line 2")


def test_peer_record_from_wire_rejects_wrong_types_and_keys():
    record = make_record("Qm1", "alice")
    assert PeerRecord.from_wire(record.to_wire()) == record
    assert PeerRecord.from_wire({**record.to_wire(), "tokens_per_s": 7}).tokens_per_s == 7.0
    assert PeerRecord.from_wire({**record.to_wire(), "step": True}) is None
    assert PeerRecord.from_wire({**record.to_wire(), "step": "12"}) is None
    assert PeerRecord.from_wire({**record.to_wire(), "extra": 1}) is None
    assert PeerRecord.from_wire([1, 2]) is None


@pytest.mark.timeout(60)
def test_records_are_signed_listed_and_cannot_be_forged():
    first = DHT(start=True, host_maddrs=LOOPBACK)
    second = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=[str(m) for m in first.get_visible_maddrs()])
    try:
        metrics = SwarmMetrics(first, "run-a")
        assert metrics.publish(make_record(str(first.peer_id), "alice"))
        assert SwarmMetrics(first, "run-b").fetch() == []  # another run's namespace is empty
        # `second` signs with its own key (a separate process would): it cannot overwrite alice's record.
        second.add_validators([RSASignatureValidator(RSAPrivateKey())])
        forged = make_record(str(first.peer_id), "mallory").to_wire()
        owner = metrics._validator.local_public_key
        assert not second.store(peer_records_key("run-a"), forged, time.time() + 60, subkey=owner)
        # Unprotected junk can be stored, but readers drop it.
        assert second.store(peer_records_key("run-a"), {"step": "junk"}, time.time() + 60, subkey=b"junk")
        names = [r.name for r in metrics.fetch()]
        assert names == ["alice"]
    finally:
        second.shutdown()
        first.shutdown()


@pytest.mark.timeout(60)
def test_peers_command_lists_the_dropped_peers_of_each_peer(capsys):
    """`tscale-peer peers` (a dial-out node of its own) shows what a live peer signed, dropped peers included;
    piped (as here) it prints tab-separated values, full peer ids and plain numbers, whatever the width."""
    host = DHT(start=True, host_maddrs=LOOPBACK)
    try:
        SwarmMetrics(host, "run-d").publish(make_record(str(host.peer_id), "alice", dropped_peers=2,
                                                        tokens_contributed=1234567890123))
        maddrs = [str(m) for m in host.get_visible_maddrs()]
        capsys.readouterr()
        assert main(["peers", "--initial-peers", *maddrs, "--run-id", "run-d", "--json"]) == 0
        (record,) = json.loads(capsys.readouterr().out)
        assert record["name"] == "alice" and record["dropped_peers"] == 2
        assert main(["peers", "--initial-peers", *maddrs, "--run-id", "run-d"]) == 0
        header, row = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
        assert header == list(PEER_COLUMNS)
        cells = dict(zip(header, row, strict=True))
        assert cells["name"] == "alice" and cells["peer id"] == str(host.peer_id)
        assert cells["dropped"] == "2" and cells["tokens"] == "1234567890123" and cells["sent"] == "1000"
    finally:
        host.shutdown()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_peers_table_on_a_terminal_is_a_table(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    terminal = _Terminal()
    print_peer_table("run-t", [make_record("12D3KooWabcdefgh12345678", "bob", dropped_peers=1)], stdout=terminal)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", terminal.getvalue()).splitlines()  # without the terminal's styles
    header, row = [line for line in lines if "dropped" in line or "bob" in line]
    assert row.split("│")[header.split("┃").index(" dropped ")].strip() == "1"
    assert "…12345678" in row and "40,960" in row


@pytest.mark.parametrize(
    "changes",
    [
        {"loss": float("nan")}, {"tokens_per_s": float("inf")}, {"last_averaging": float("-inf")},
        {"updated_at": float("nan")}, {"name": "x" * 10_000}, {"name": "\x1b[2J\x1b[31mred"}, {"device": "a\nb"},
        {"peer_id": "12D3KooW" + "A" * 100}, {"step": -1}, {"bytes_sent": 2**64}, {"tokens_per_s": -5.0},
        {"offload": 1}, {"loss": "2.5"}, {"tokens_per_s": 1e300}, {"loss": -1e300},
    ],
    ids=lambda changes: next(iter(changes)) + "=" + repr(next(iter(changes.values())))[:12],
)
def test_peer_record_from_wire_refuses_non_finite_numbers_and_unbounded_values(changes):
    wire = {**fake_record(1).to_wire(), **changes}
    assert PeerRecord.from_wire(wire) is None


def test_a_diverged_local_loss_is_published_as_none():
    wire = fake_record(1, loss=float("nan")).to_wire()
    assert wire["loss"] is None and PeerRecord.from_wire(wire) == fake_record(1, loss=None, updated_at=wire["updated_at"])


def test_a_public_name_others_would_refuse_is_refused_at_the_command_line():
    assert check_public_name("lab-h200") == "lab-h200" and check_public_name(None) is None
    for bad in ("x" * (MAX_NAME_CHARS + 1), "tab\there"):
        with pytest.raises(UserError, match="--name must be at most"):
            check_public_name(bad)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hostile_records_are_dropped_and_peers_json_stays_valid_json(capsys, monkeypatch):
    """Signed records with NaN, infinities, huge or control-character strings, absurd numbers or far-off times,
    and well-formed but unsigned ones, from other peers: `peers --json` lists only the honest peers, as strict JSON,
    and the table shows a name that looks like markup as it is."""
    host = DHT(start=True, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in host.get_visible_maddrs()]
    now = time.time()
    hostile = [
        {"loss": float("nan")}, {"tokens_per_s": float("inf")}, {"name": "n" * 1000}, {"name": "\x1b]0;pwned\x07"},
        {"bytes_received": 2**64 - 1}, {"updated_at": now + 10**9}, {"updated_at": now - 10**6}, {"extra": "field"},
    ]
    wires = [{**fake_record(i).to_wire(), **changes} for i, changes in enumerate(hostile)]
    wires.append(fake_record(99, name="[/bold] mallory").to_wire())  # valid, and markup to rich
    attacker = flood(maddrs, "run-h", wires, [fast_rsa_key() for _ in wires])
    try:
        SwarmMetrics(host, "run-h").publish(make_record(str(host.peer_id), "alice"))
        unsigned = fake_record(100, name="unsigned").to_wire()
        assert attacker.store(peer_records_key("run-h"), unsigned, time.time() + 60, subkey=b"no owner")
        capsys.readouterr()
        assert main(["peers", "--initial-peers", *maddrs, "--run-id", "run-h", "--json"]) == 0

        def refuse(constant):
            raise AssertionError(f"not strict JSON: {constant}")

        records = json.loads(capsys.readouterr().out, parse_constant=refuse)
        assert [record["name"] for record in records] == ["[/bold] mallory", "alice"]
    finally:
        attacker.shutdown()
        host.shutdown()
    monkeypatch.setenv("COLUMNS", "200")
    terminal = _Terminal()
    print_peer_table("run-h", [PeerRecord(**record) for record in records], stdout=terminal)
    assert "[/bold] mallory" in terminal.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_flood_of_fake_peers_is_cut_to_the_freshest_records(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_PEER_RECORDS", 3)
    host = DHT(start=True, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in host.get_visible_maddrs()]
    now = time.time()
    wires = [fake_record(i, updated_at=now - 10 - i).to_wire() for i in range(6)]
    attacker = flood(maddrs, "run-f", wires, [fast_rsa_key() for _ in wires])
    try:
        metrics = SwarmMetrics(host, "run-f")
        metrics.publish(make_record(str(host.peer_id), "alice"))
        assert [r.name for r in metrics.fetch()] == ["alice", "fake-0", "fake-1"]
    finally:
        attacker.shutdown()
        host.shutdown()
