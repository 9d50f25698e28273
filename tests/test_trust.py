"""What a joiner adopts, and the DHT records that steer a run, against hostile peers: real hivemind DHT nodes and
averagers on 127.0.0.1, in this process. The attackers live here: forged and far-expiring run configs, poisoned
states, fake progress records."""

from __future__ import annotations

import contextlib
import threading
import time

import hivemind
import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from tscale_p2p.config import TrainConfig
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.averaging import SwarmAverager
from tscale_p2p.peers.ban_notes import MAX_NOTED_BANS, BanNotes, ban_note_record
from tscale_p2p.peers.progress import RoundClock, progress_record
from tscale_p2p.peers.records import (
    RunRecordValidator,
    protect,
    read_signed,
    signer_for,
    signing_key,
    use_identity_key,
)
from tscale_p2p.peers.run_config import (
    SignedRun,
    RunConfig,
    fetch_signed_run,
    publish_run_config,
    run_config_record,
)
from tscale_p2p.peers.state_download import StateCheck, announce_state, state_offer_record
from tscale_p2p.peers.swarm_state import fingerprint

from record_attacks import FakePeers

pytestmark = [pytest.mark.slow]  # each starts a few DHT nodes (and averagers): seconds, not milliseconds

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "trust"


@pytest.fixture
def nodes(tmp_path):
    """nodes(name) starts a DHT node signing with its libp2p identity, joined to the first one; all are shut
    down at teardown."""
    started: list[hivemind.DHT] = []

    def start(name: str) -> hivemind.DHT:
        path = str(tmp_path / f"{name}.key")
        initial = started[0].get_visible_maddrs() if started else []
        dht = hivemind.DHT(host_maddrs=LOOPBACK, initial_peers=initial, identity_path=path, start=True)
        started.append(dht)
        use_identity_key(dht, path)
        protect(dht, run_config_record(RUN), progress_record(RUN), state_offer_record(RUN), ban_note_record(RUN))
        return dht

    yield start
    for dht in reversed(started):
        dht.shutdown()


def config(**train) -> RunConfig:
    return RunConfig.from_settings(TrainConfig(**train), ModelConfig.from_dims("e32h2d2w64"), "byte", 50, 0.7, 0.9)


def test_a_joiner_adopts_the_founders_signed_config_and_refuses_forgeries(nodes):
    founder, joiner, forger = nodes("founder"), nodes("joiner"), nodes("forger")
    honest = SignedRun.sign(config(), RUN, signing_key(founder))
    assert honest.founder_id == str(founder.peer_id)  # signed by the id the join line carries
    assert publish_run_config(founder, RUN, honest)

    # The forger signs a hijacking config (lr x100) with its own key, and re-publishes the founder's record with a
    # tampered config under the founder's signature: both stored (they are its own signed records), both ignored.
    hijack = config(lr=0.3)
    assert publish_run_config(forger, RUN, SignedRun.sign(hijack, RUN, signing_key(forger)))
    tampered = SignedRun(hijack, honest.founder, honest.signature)
    assert not tampered.valid_for(RUN)
    # Refused by every node: a far expiry, no owner, a malformed or huge value.
    own = signer_for(forger).local_public_key
    record = honest.to_record().model_dump()
    key = run_config_record(RUN).key
    assert not forger.store(key, record, get_dht_time() + 10**7, subkey=own)
    assert not forger.store(key, record, get_dht_time() + 60, subkey=b"no owner")
    assert not forger.store(key, {**record, "hash": "x" * 64}, get_dht_time() + 60, subkey=own)
    # (A value over the key's size bound is refused by the same validator; through a DHT's own pipe a value of
    # tens of KiB can stall hivemind's process, so it is checked directly.)
    oversized = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(own),
                          MSGPackSerializer.dumps({**record, "config": {"junk": "x" * 20_000}}), get_dht_time() + 60)
    assert not RunRecordValidator([run_config_record(RUN)]).validate(oversized)
    assert not forger.store(key, "not a record", get_dht_time() + 60, subkey=own)

    adopted = fetch_signed_run(joiner, RUN, trusted={str(founder.peer_id)})
    assert adopted.config == config() and adopted.founder_id == str(founder.peer_id)
    # Honest re-publishes work: the founder refreshing its record, and a joiner carrying the founder's signature.
    assert publish_run_config(founder, RUN, honest) and publish_run_config(joiner, RUN, adopted)
    late = nodes("late")
    # A newcomer that came in through the joiner's address trusts what the joiner vouches for.
    assert fetch_signed_run(late, RUN, trusted={str(joiner.peer_id)}).config == config()
    # Through a plain DHT node, vouched for by nobody: two founders claim the run, so it says whose to trust.
    with pytest.raises(UserError, match="2 different configs .* join through the founder's address"):
        fetch_signed_run(late, RUN, trusted={"QmSomeBootstrapNode"})
    # Nothing at all was stored under the run's key with a far expiry.
    assert all(e.expiration_time < get_dht_time() + 25 * 3600 for e in read_signed(late, run_config_record(RUN)))



SHAPES = [(16, 8), (8,)]


def honest_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def state(tensors: list[torch.Tensor], round_number: int = 5, **metadata) -> tuple[dict, list[torch.Tensor]]:
    """A shared state as `SwarmState.to_wire` makes it: the weights, then as many momentum buffers."""
    meta = {"format": 1, "run_hash": config().hash, "round": round_number, "step": 250,
            "weights": fingerprint(tensors), "schedule_origin": 0, **metadata}
    return meta, [*tensors, *(torch.zeros_like(t) for t in tensors)]


class Donor:
    """A peer sharing the state `serve` returns (an attacker's is swapped between downloads); counts requests."""

    def __init__(self, dht, serve):
        self.dht, self.serve, self.asked = dht, serve, 0
        self.averager = SwarmAverager([torch.zeros(1)], dht, prefix=f"{RUN}_grad", state_source=self._state,
                                      allow_state_sharing=True)

    def _state(self):
        self.asked += 1
        return self.serve()

    def offer(self, round_number: int, weights: str) -> None:
        assert announce_state(self.dht, RUN, config().hash, round_number, weights)


@pytest.mark.timeout(120)
def test_a_poisoned_state_is_refused_and_the_joiner_gets_the_majoritys(nodes):
    """One honest donor, one poisoner whose offer is the freshest (so it is asked first when it offers the
    majority's base): each poison is refused and the joiner downloads the honest state from the other peer."""
    honest_node, poison_node, joiner_node = nodes("honest"), nodes("poison"), nodes("joiner")
    honest = Donor(honest_node, lambda: state(honest_weights()))
    poison = Donor(poison_node, lambda: state(honest_weights()))
    check = StateCheck(RUN, config().hash, tuple(SHAPES))
    joiner = SwarmAverager([torch.zeros(1)], joiner_node, prefix=f"{RUN}_grad", client_mode=True, state_check=check)
    base = (5, fingerprint(honest_weights()))
    random_weights = [torch.randn(shape) * 30 for shape in SHAPES]
    attacks = {
        # finite random weights at a huge claimed round: a tie of one offer each goes to the lower round
        "a huge round": ((1_000_000, fingerprint(random_weights)), lambda: state(random_weights, 1_000_000)),
        # the majority's base announced, other weights served
        "weights that are not the offer's": (base, lambda: state(random_weights, weights=base[1])),
        "NaN": (base, lambda: state([torch.full(s, float("nan")) for s in SHAPES], weights=base[1])),
        "a tensor declared 16 MiB": (base, lambda: state([torch.zeros(2048, 2048), honest_weights()[1]],
                                                         weights=base[1])),
        "wrong shapes": (base, lambda: state([torch.zeros(8, 16), torch.zeros(8)], weights=base[1])),
        "a round that is no integer": (base, lambda: state(honest_weights(), "5")),
        "another run config": (base, lambda: state(honest_weights(), run_hash="0" * 64)),
    }
    try:
        honest.offer(*base)
        for name, (offer, serve) in attacks.items():
            poison.serve, asked_before = serve, poison.asked
            time.sleep(0.05)  # its offer is the fresher one
            poison.offer(*offer)
            downloaded = joiner.load_state_from_peers(wait=True, timeout=30)
            assert downloaded is not None, name
            metadata, tensors = downloaded
            assert metadata["donor"] == str(honest_node.peer_id), name
            assert all(torch.equal(t, w) for t, w in zip(tensors, honest_weights())), name
            assert check.problem(metadata, tensors) is None
            # The poisoner was asked exactly when it offered the majority's base (and was refused then).
            assert poison.asked == asked_before + (offer == base), name
        assert check.problem(*state(honest_weights(), round="abc")).startswith("malformed metadata (round")
    finally:
        for averager in (joiner, poison.averager, honest.averager):
            averager.shutdown()


@pytest.mark.timeout(120)
def test_the_offer_of_a_peer_that_left_does_not_keep_a_joiner_from_the_live_state(nodes):
    """A peer that left leaves its offer in the DHT for a minute; tied with a live peer's offer at a later round,
    its lower round is the base. Nobody offering it answers, so the joiner counts the other offers and downloads
    the live peer's state (it used to find no state until the dead offer expired)."""
    live_node, left_node, joiner_node = nodes("live"), nodes("left"), nodes("joiner")
    live = Donor(live_node, lambda: state(honest_weights(), 6))
    left = Donor(left_node, lambda: state(honest_weights()))
    check = StateCheck(RUN, config().hash, tuple(SHAPES))
    joiner = SwarmAverager([torch.zeros(1)], joiner_node, prefix=f"{RUN}_grad", client_mode=True, state_check=check)
    try:
        left.offer(5, fingerprint([w * 2 for w in honest_weights()]))
        left.averager.shutdown()  # its offer stays; its RPCs are gone
        live.offer(6, fingerprint(honest_weights()))
        downloaded = joiner.load_state_from_peers(wait=True, timeout=60)
        assert downloaded is not None
        metadata, tensors = downloaded
        assert metadata["donor"] == str(live_node.peer_id) and metadata["round"] == 6
        assert all(torch.equal(t, w) for t, w in zip(tensors, honest_weights()))
    finally:
        for averager in (joiner, live.averager):
            averager.shutdown()


@contextlib.contextmanager
def old_and_new_offers(nodes, new_round: int):
    """(old, new, joiner): `old` offers other weights at round 5, `new` the honest weights at `new_round`, and a
    joiner downloads; one offer each is a tie, which goes to the lower round."""
    old_weights = [w * 2 for w in honest_weights()]
    old = Donor(nodes("old"), lambda: state(old_weights, 5))
    new = Donor(nodes("new"), lambda: state(honest_weights(), new_round))
    check = StateCheck(RUN, config().hash, tuple(SHAPES))
    joiner = SwarmAverager([torch.zeros(1)], nodes("joiner"), prefix=f"{RUN}_grad", client_mode=True,
                           state_check=check)
    try:
        old.offer(5, fingerprint(old_weights))
        new.offer(new_round, fingerprint(honest_weights()))
        yield old, new, joiner
    finally:
        for averager in (joiner, old.averager, new.averager):
            averager.shutdown()


@pytest.mark.timeout(120)
def test_a_peer_resyncing_to_its_groups_base_downloads_it_from_a_tie(nodes):
    """Right after a round one peer may still offer the old base while another offers the new one: a tie, which
    goes to the lower round. A peer out of step with its group asks for the group's base (`prefer`) and gets it
    (it used to download the old base, find it was not the group's, and stay out of step round after round)."""
    with old_and_new_offers(nodes, 6) as (old, new, joiner):
        group_base = (6, fingerprint(honest_weights()))
        assert joiner.load_state_from_peers(wait=True, timeout=60)[0]["round"] == 5  # the tie's lower round
        metadata, tensors = joiner.load_state_from_peers(wait=True, timeout=60, prefer=group_base)
        assert metadata["donor"] == str(new.dht.peer_id) and metadata["round"] == 6
        assert all(torch.equal(t, w) for t, w in zip(tensors, honest_weights()))
        # a preferred base that nobody offers changes nothing: a liar's group cannot name a state of its own
        assert joiner.load_state_from_peers(wait=True, timeout=60, prefer=(7, "0" * 12))[0]["round"] == 5


@pytest.mark.timeout(120)
def test_a_peer_resyncing_takes_the_later_state_its_groups_declarers_moved_on_to(nodes):
    """The groupmate that declared the group's base applied the round before we asked, and now offers the next
    state: a resync takes that (it chased stale offers round after round otherwise), but only where most of the
    base's declarers offer it, and never from a peer that did not declare the group's base."""
    with old_and_new_offers(nodes, 7) as (old, new, joiner):
        group_base = (6, "0" * 12)  # what `new` declared in our group; it offers round 7 by now

        def resync(*declarers: Donor) -> dict:
            return joiner.load_state_from_peers(wait=True, timeout=60, prefer=group_base, prefer_donors=[
                str(donor.dht.peer_id) for donor in declarers])[0]

        metadata = resync(new)
        assert metadata["donor"] == str(new.dht.peer_id) and metadata["round"] == 7
        assert resync(old)["round"] == 5  # `old` offers no later state: the tie's lower round, as without
        assert resync(old, new)["round"] == 5  # one of two declarers is no majority for the later state
        assert resync()["round"] == 5


@pytest.mark.timeout(120)
def test_a_state_a_round_newer_than_the_offers_is_taken_once_they_announce_it(nodes):
    """Donors that apply a round while a peer downloads send the next round's state before their offers say so
    (they re-announce right after the round): it is taken once most offers announce it, within moments; a
    resyncing peer that refused it stayed a round behind its group. Never announced, it is refused."""
    first_node, second_node, joiner_node = nodes("first"), nodes("second"), nodes("joiner")
    old_weights = [w * 2 for w in honest_weights()]
    donors = [Donor(node, lambda: state(honest_weights(), 6)) for node in (first_node, second_node)]
    check = StateCheck(RUN, config().hash, tuple(SHAPES))
    joiner = SwarmAverager([torch.zeros(1)], joiner_node, prefix=f"{RUN}_grad", client_mode=True, state_check=check)
    try:
        for donor in donors:
            donor.offer(5, fingerprint(old_weights))
        assert joiner.load_state_from_peers(wait=True, timeout=60) is None  # round 6 served, never announced
        announce = threading.Timer(1.0, lambda: [donor.offer(6, fingerprint(honest_weights())) for donor in donors])
        announce.start()
        metadata, tensors = joiner.load_state_from_peers(wait=True, timeout=60)
        announce.join()
        assert metadata["round"] == 6 and all(torch.equal(t, w) for t, w in zip(tensors, honest_weights()))
    finally:
        for averager in (joiner, *(donor.averager for donor in donors)):
            averager.shutdown()


def test_the_majority_base_wins_and_ties_go_to_the_lower_round():
    from tscale_p2p.peers.state_download import StateOffer, majority_base

    def offer(r, w):
        return StateOffer(run_hash="a" * 64, round=r, weights=w)

    assert majority_base([offer(9, "b" * 12), offer(5, "a" * 12), offer(5, "a" * 12)]) == (5, "a" * 12)
    assert majority_base([offer(10**6, "b" * 12), offer(5, "a" * 12)]) == (5, "a" * 12)
    assert majority_base([]) is None


@pytest.mark.timeout(120)
def test_fake_progress_records_do_not_stall_rounds(nodes):
    """50 fake peers (signed records, each with a key of its own, of zero progress in the current round) stretch a
    new peer's round to 26 x H steps. Once it has averaged with a real peer, a record of a peer it has not met
    counts between its own steps and H: its round ends after H steps as without them, fakes claiming to be
    ahead cannot make it late, and its rounds' groups expect only a few newcomers. Unsigned and far-expiring
    fakes are refused by every node."""
    a_node, b_node = nodes("a"), nodes("b")
    attacker = hivemind.DHT(host_maddrs=LOOPBACK, initial_peers=a_node.get_visible_maddrs(), start=True)
    fakes = FakePeers(attacker, 50)
    a = RoundClock(a_node, RUN, str(a_node.peer_id), inner_steps=10, every_s=0.2)
    b = RoundClock(b_node, RUN, str(b_node.peer_id), inner_steps=10, every_s=0.2)
    key = progress_record(RUN).key
    try:
        b.update(epoch=0, steps=10, steps_per_s=0.0)  # b has made its share of round 0
        a.update(epoch=0, steps=1, steps_per_s=0.0)
        b._exchange()

        assert fakes.claim_progress(RUN, epoch=0)
        now = time.time()
        assert not attacker.store(key, [0, 0, 0.0, now], get_dht_time() + 30, subkey=b"fake-peer")  # unsigned
        assert not attacker.store(key, {"epoch": 0, "steps": 0, "steps_per_s": 0.0, "time": now},
                                  get_dht_time() + 10**6, subkey=fakes.owners[0])
        a._exchange()
        assert a.peers_in(0) == 52  # b and the fakes: every one is read
        assert not a.round_done(0, 10) and not a.round_done(0, 500)  # a new peer is stalled: 26 x H steps
        a.confirm([str(b_node.peer_id)])  # a has averaged with b
        assert not a.round_done(0, 9) and a.round_done(0, 10)  # H steps, as with b alone
        assert a.live_peers() == 2 + 2  # a, b and at most two newcomers
        assert fakes.claim_progress(RUN, epoch=1)  # all fakes "ahead": b is not, so a is not late
        a._exchange()
        assert not a.round_done(0, 1) and a.round_done(0, 10)
    finally:
        attacker.shutdown()


def test_bans_are_told_under_each_peers_own_signature_and_bounded(nodes):
    """A peer's note names the peers it banned and the round of each ban, read as that peer's (its signature's)
    word; a note that claims another peer's name, names too many or ill-formed ids, or gives no round or a negative
    one for a ban, is refused by every node."""
    teller_node, reader_node, forger_node = nodes("teller"), nodes("reader"), nodes("forger")
    teller = BanNotes(teller_node, RUN, str(teller_node.peer_id))
    reader = BanNotes(reader_node, RUN, str(reader_node.peer_id))
    attacker_id = str(forger_node.peer_id)
    teller.exchange([attacker_id], round_number=4)
    teller.exchange([attacker_id, str(reader_node.peer_id)], round_number=6)  # a ban keeps the round first told
    reader.exchange([], round_number=9)  # nothing banned: nothing published
    assert reader.noted_by([str(teller_node.peer_id)]) == {attacker_id: 4}  # never ourselves
    assert reader.noted_by([attacker_id]) == {}
    key = ban_note_record(RUN).key
    owner = signer_for(forger_node).local_public_key
    for banned in (("Qm" + "1" * 44,) * (MAX_NOTED_BANS + 1), ("not base58: 0OIl",), ("Q" * 65,)):
        assert not forger_node.store(key, {"banned": banned, "rounds": (0,) * len(banned)}, get_dht_time() + 30,
                                     subkey=owner)
    for rounds in ((), (0, 1), (-1,), ("1",)):
        assert not forger_node.store(key, {"banned": (attacker_id,), "rounds": rounds}, get_dht_time() + 30,
                                     subkey=owner)
    assert not forger_node.store(key, {"banned": (attacker_id,), "rounds": (0,)}, get_dht_time() + 30,
                                 subkey=signer_for(teller_node).local_public_key)  # signed by someone else
    assert forger_node.store(key, {"banned": (str(teller_node.peer_id),), "rounds": (3,)}, get_dht_time() + 30,
                             subkey=owner)
    reader.exchange([], round_number=9)
    assert reader.noted_by([attacker_id]) == {str(teller_node.peer_id): 3}  # well-formed: its own word
    assert reader.noted_by([str(teller_node.peer_id)]) == {attacker_id: 4}  # the forgery changed nothing
