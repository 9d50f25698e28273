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

from tscale_p2p.cli import main
from tscale_p2p.cli.swarm import PEER_COLUMNS, print_peer_table
from tscale_p2p.peers.metrics import PeerRecord, SwarmMetrics, peer_records_key
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
