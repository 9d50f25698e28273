"""One config system: each flag declared once in a section, taken alike by every command that has it; a
`--config` TOML file of tables (or top-level keys) under the flags; every bad value one line, exit 2."""

from pathlib import Path

import pytest

from tscale_p2p.cli import TRAIN, build_parser, main, train_config
from tscale_p2p.cli.generate import INFER, SERVE
from tscale_p2p.cli.swarm import JOIN, WATCH, join_inputs
from tscale_p2p.errors import UserError

NETWORK_COMMANDS = {"join": JOIN, "peers": WATCH, "dashboard": WATCH, "infer": INFER, "serve": SERVE}
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmX2jXBEjUG1a4Na2zp8icDAy92brp2EMDNKFt1eJp2gQS"


def _one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tscale-peer: error:"), err
    return err


@pytest.mark.parametrize("command", NETWORK_COMMANDS)
def test_a_network_flag_is_taken_and_checked_alike_by_every_command(command, capsys):
    loaded = NETWORK_COMMANDS[command].load(build_parser().parse_args([command, "--initial-peers", PEER,
                                                                       "--run-id", "shared"]))
    assert loaded["network"].initial_peers == (PEER,) and loaded["network"].run_id == "shared"
    assert "is not a valid multiaddr" in _one_line_error(capsys, [command, "--initial-peers", "garbage"])
    assert "invalid --run-id" in _one_line_error(capsys, [command, "--initial-peers", PEER, "--run-id", "bad id!"])


@pytest.mark.parametrize("command", ["peers", "dashboard", "infer", "serve"])
def test_commands_that_only_dial_out_take_no_listening_flags(command, capsys):
    assert "--host-maddrs" in _one_line_error(capsys, [command, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])


def test_help_groups_the_flags_by_section(capsys):
    with pytest.raises(SystemExit):
        main(["join", "--help"])
    out = capsys.readouterr().out
    for table in ("network:", "swarm:", "model:", "data:", "optim:", "device:", "run:"):
        assert f"\n{table}" in out, table
    assert "\nsync:" not in out and "--resume" not in out  # data-parallel `train` only; join always resumes


def test_tables_top_level_keys_and_flags_layer_in_order(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('steps = 9\n[optim]\nlr = 1e-4\n[data]\nbatch-size = 2\n[model]\nmodel = "e32h2d2w32"\n')
    loaded = TRAIN.load(build_parser().parse_args(["train", "--config", str(config), "--lr", "5e-4"]))
    cfg = train_config(loaded)
    assert (cfg.steps, cfg.lr, cfg.batch_size, cfg.model, cfg.warmup) == (9, 5e-4, 2, "e32h2d2w32", 100)
    assert loaded.chosen == {"steps", "lr", "batch_size", "model"}


def test_join_takes_every_section_from_one_file(tmp_path):
    config = tmp_path / "join.toml"
    config.write_text(f'[network]\ninitial-peers = ["{PEER}"]\nrun-id = "filed"\n[swarm]\ninner-steps = 7\n'
                      '[optim]\nlr = 1e-4\n')
    cfg, explicit, options = join_inputs(build_parser().parse_args(["join", "--config", str(config), "--steps", "50"]))
    assert options.network.initial_peers == (PEER,) and options.run_id == "filed" and options.swarm.inner_steps == 7
    assert cfg.out.endswith("filed") and cfg.lr == 1e-4
    assert explicit == {"inner_steps": 7, "lr": 1e-4, "steps": 50}  # what must agree with a run being joined


def test_environment_variables_are_not_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIM", '{"lr": 9}')
    monkeypatch.setenv("LR", "9")
    config = tmp_path / "empty.toml"
    config.write_text("")
    assert train_config(TRAIN.load(build_parser().parse_args(["train", "--config", str(config)]))).lr == 3e-3


@pytest.mark.parametrize("command, body, fragment", [
    ("train", "[optimizer]\nlr = 1\n", "unknown key 'optimizer'"),
    ("train", "[optim]\ncolour = 1\n", "unknown key 'colour' in [optim]"),
    ("train", "[model]\nlr = 1\n", "it belongs in [optim]"),
    ("train", "[optim]\nsteps = 0\n", "key 'steps' in config file"),
    ("train", "[device]\nprecision = 'fp4'\n", "precision' in config file"),
    ("train", "[launch]\nnproc-per-node = 0\n", "key 'nproc_per_node' in config file"),
    ("train", '[launch]\nnproc-per-node = 2\nnnodes = 2\nrdzv-endpoint = "10.0.0.1:99999"\n',
     "rdzv-endpoint '10.0.0.1:99999' is not HOST:PORT"),
    ("train", "[launch]\nnnodes = 2\n", "add --nproc-per-node"),
    ("join", "[sync]\nsync-timeout = 5\n", "unknown key 'sync'"),  # a section join does not take
    ("join", "[launch]\nnproc-per-node = 2\n", "unknown key 'launch'"),
    ("join", "[swarm]\ninner-steps = 0\n", "must be at least 1, got 0"),
    ("join", '[swarm]\nname = "tab\\there"\n', "--name must be at most 64 printable characters"),  # TOML's tab
    ("peers", '[network]\ninitial-peers = ["garbage"]\n', "is not a valid multiaddr"),
    ("peers", "[network]\nport = 5\n", "unknown key 'port' in [network]"),
    ("serve", "[serve]\nport = 70000\n", "port"),
    ("infer", "[sampling]\nstop = 3\n", "stop"),
])
def test_a_bad_config_file_is_one_line(command, body, fragment, tmp_path, capsys):
    (tmp_path / "bad.toml").write_text(body)
    argv = [command, "--config", str(tmp_path / "bad.toml")]
    assert fragment in _one_line_error(capsys, argv)


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    assert "does not exist" in _one_line_error(capsys, ["peers", "--config", str(tmp_path / "none.toml")])


def test_a_watcher_without_initial_peers_is_told_what_to_give(capsys):
    assert "give --initial-peers" in _one_line_error(capsys, ["peers"])


def test_the_readmes_config_example_is_a_valid_join_config(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (tmp_path / "join.toml").write_text(readme.split("```toml\n")[1].split("```")[0])
    with pytest.raises(UserError, match="initial-peers"):  # its peer id is a placeholder; a flag replaces it
        join_inputs(build_parser().parse_args(["join", "--config", str(tmp_path / "join.toml")]))
    cfg, _, options = join_inputs(build_parser().parse_args(["join", "--config", str(tmp_path / "join.toml"),
                                                              "--initial-peers", PEER]))
    assert (cfg.model, cfg.steps, cfg.lr) == ("e384h6d6w256", 1000, 1e-3)
    assert options.network.initial_peers == (PEER,)
