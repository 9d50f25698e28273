"""The run config a swarm shares: adoption by joiners, refusal of contradicting flags, tamper checks."""

from dataclasses import replace

import pytest

from tscale_p2p.config import TrainConfig
from tscale_p2p.errors import UserError
from tscale_p2p.model import ModelConfig
from tscale_p2p.peers.run_config import RunConfig, check_run_id, load_saved_run_config, save_run_config
from tscale_p2p.peers.settings import default_outer_lr_peak


def founder_config(**train) -> RunConfig:
    cfg = TrainConfig(**{"lr": 1e-3, "steps": 500, **train})
    return RunConfig.from_settings(cfg, ModelConfig.from_dims("e32h2d2w64"), "byte", 50, 0.7, 0.9)


def test_a_joiner_adopts_the_runs_model_and_schedule_but_keeps_its_own_peer_settings():
    run = founder_config()
    mine = run.apply_to(TrainConfig(batch_size=3, data="here.txt", lr=9.0, steps=7))
    assert (mine.model, mine.lr, mine.steps) == ("e32h2d2w64", 1e-3, 500)
    assert (mine.batch_size, mine.data) == (3, "here.txt")


@pytest.mark.parametrize(
    "explicit, message",
    [
        ({"model": "e64h2d2w64"}, "--model e64h2d2w64 contradicts run 'r', which uses model e32h2d2w64"),
        ({"lr": 0.01}, "--lr 0.01 contradicts run 'r', which uses lr 0.001"),
        ({"inner_steps": 20}, "--inner-steps 20 contradicts run 'r', which uses inner-steps 50"),
        ({"mlp": "swiglu"}, "--mlp swiglu contradicts"),
        ({"codec": "topk"}, "--codec topk contradicts run 'r', which uses codec sign"),
    ],
)
def test_contradicting_flags_are_refused_naming_the_difference(explicit, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        founder_config().check_flags("r", explicit)


def test_agreeing_and_per_peer_flags_pass():
    founder_config().check_flags("r", {"model": "w64e32d2h2", "lr": 0.001, "batch_size": 99, "inner_steps": 50})


def test_wire_round_trip_and_tampering():
    run = founder_config()
    assert RunConfig.from_wire(run.to_wire()) == run
    tampered = run.to_wire()
    tampered["config"]["inner_steps"] = 1
    with pytest.raises(UserError, match="does not match its hash"):
        RunConfig.from_wire(tampered)
    broken = run.to_wire()
    broken["config"]["inner_steps"] = "many"
    with pytest.raises(UserError, match="malformed"):
        RunConfig.from_wire(broken)
    with pytest.raises(UserError, match="malformed"):
        RunConfig.from_wire(["not", "a", "dict"])


def test_hash_changes_with_any_shared_setting():
    run = founder_config()
    assert replace(run, outer_lr=0.5).hash != run.hash
    assert founder_config(warmup=3).hash != run.hash


def test_saved_run_config_round_trip(tmp_path):
    assert load_saved_run_config(tmp_path) is None
    save_run_config(tmp_path / "out", founder_config())
    assert load_saved_run_config(tmp_path / "out") == founder_config()


@pytest.mark.parametrize("run_id", ["", "-x", "a b", "x" * 65, "a/b"])
def test_bad_run_ids(run_id):
    with pytest.raises(UserError, match="invalid --run-id"):
        check_run_id(run_id)


def test_later_settings_at_their_defaults_leave_the_run_config_as_before():
    run = founder_config()
    assert "embedding_weight_decay" not in run.train and "tie_embeddings" not in run.model
    decayed = founder_config(embedding_weight_decay=0.1)
    assert decayed.train["embedding_weight_decay"] == 0.1 and decayed.hash != run.hash
    # a joiner adopts the default of a run that predates the setting, and may not contradict it
    assert run.apply_to(TrainConfig(embedding_weight_decay=0.5)).embedding_weight_decay == 0.0
    with pytest.raises(UserError, match="--embedding-weight-decay 0.5 contradicts run 'r'"):
        run.check_flags("r", {"embedding_weight_decay": 0.5})


def test_a_joiner_adopts_the_runs_tied_head_and_attention_dropout():
    cfg = TrainConfig(lr=1e-3, steps=500)
    model = ModelConfig.from_dims("e32h2d2w64", tie_embeddings=True, attention_dropout=0.1)
    run = RunConfig.from_settings(cfg, model, "byte", 50, 0.7, 0.9)
    mine = run.apply_to(TrainConfig())
    assert (mine.tie_embeddings, mine.attention_dropout) == (True, 0.1)
    with pytest.raises(UserError, match="--tie-embeddings False contradicts"):
        run.check_flags("r", {"tie_embeddings": False})


def test_the_codec_is_a_run_setting_and_sign_runs_keep_the_hash_they_had_without_one():
    sign, topk = founder_config(), replace(founder_config(), codec="topk")
    assert topk.hash != sign.hash
    assert RunConfig.from_wire(topk.to_wire()) == topk
    record = sign.to_wire()
    assert "codec" not in record["config"]  # as a record published before runs chose a codec
    assert RunConfig.from_wire(record) == sign
    with pytest.raises(UserError, match="codec must be one of sign, e8, e8s, topk, got 'gzip'"):
        replace(sign, codec="gzip")


def test_opening_rounds_are_a_run_setting_and_runs_without_them_keep_their_hash():
    plain = founder_config()
    opened = replace(plain, opening_rounds=30, opening_inner_steps=5)
    assert opened.hash != plain.hash and replace(opened, opening_inner_steps=6).hash != opened.hash
    assert replace(opened, opening_outer_lr=1.0).hash != opened.hash
    assert replace(plain, opening_outer_lr=1.0).hash == plain.hash  # no opening rounds: their lr plays no part
    assert "opening_rounds" not in plain.to_wire()["config"]  # as a record published before runs had them
    assert RunConfig.from_wire(opened.to_wire()) == opened
    with pytest.raises(UserError, match="--opening-rounds 0 contradicts run 'r', which uses opening-rounds 30"):
        opened.check_flags("r", {"opening_rounds": 0})
    with pytest.raises(UserError, match="opening-rounds must be at least 0, got -1"):
        replace(plain, opening_rounds=-1)
    with pytest.raises(UserError, match="opening-outer-lr must be positive, got 0"):
        replace(plain, opening_outer_lr=0)


def test_an_outer_lr_that_falls_with_the_inner_one_is_a_run_setting_and_runs_without_it_keep_their_hash():
    plain = founder_config()
    falling = replace(plain, outer_lr_peak=1.5)
    assert falling.hash != plain.hash and "outer_lr_peak" not in plain.to_wire()["config"]
    assert RunConfig.from_wire(falling.to_wire()) == falling
    assert [falling.outer_lr_at(ratio) for ratio in (1.0, 0.5, 0.0)] == [1.5, 0.5 * (1.5 + plain.outer_lr),
                                                                          plain.outer_lr]
    assert plain.outer_lr_at(1.0) == plain.outer_lr
    with pytest.raises(UserError, match="--outer-lr-peak 2.0 contradicts run 'r', which uses outer-lr-peak 1.5"):
        falling.check_flags("r", {"outer_lr_peak": 2.0})
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(UserError, match="outer-lr-peak must be positive"):
            replace(plain, outer_lr_peak=bad)


def test_a_new_run_with_opening_rounds_lets_its_outer_lr_fall_by_default():
    assert default_outer_lr_peak(1.0, opening_rounds=60) == 1.5 and default_outer_lr_peak(2.0, opening_rounds=1) == 3.0
    assert default_outer_lr_peak(1.0, opening_rounds=0) is None
