"""TrainConfig: flags generated from the dataclass, config files as defaults, stored round trip."""

from __future__ import annotations

import pytest

from trainers.config import TrainConfig, parse_command_line, read_config_file


def test_flags_come_from_fields_with_types_and_choices():
    command, config = parse_command_line(
        [
            "--train-shards",
            "data/manifest.json",
            "--batch-size",
            "8",
            "--accum-steps",
            "4",
            "--amp",
            "bf16",
            "--no-progress",
            "--channels-last",
            "--warmup-steps",
            "5",
            "--probe-batches",
            "2,4,16",
            "--lr",
            "0.2",
        ]
    )
    assert command == "train"
    assert config.batch_size == 8 and config.accum_steps == 4
    assert config.amp == "bf16" and config.progress is False and config.channels_last is True
    assert config.warmup_steps == 5 and config.probe_batches == (2, 4, 16)
    assert config.lr == 0.2 and isinstance(config.lr, float)


def test_subcommands_take_the_same_flags():
    command, config = parse_command_line(["scan-throughput", "--scan-batch-sizes", "4,8"])
    assert command == "scan-throughput" and config.scan_batch_sizes == (4, 8)
    command, _ = parse_command_line(["find-batch-size"])
    assert command == "find-batch-size"


def test_bad_choice_and_bad_value_exit_with_usage(capsys):
    with pytest.raises(SystemExit):
        parse_command_line(["--amp", "fp8"])
    with pytest.raises(SystemExit):
        parse_command_line(["--batch-size", "0"])
    assert "--batch-size must be at least 1" in capsys.readouterr().err


def test_toml_file_gives_defaults_and_flags_win(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('batch-size = 12\nlr = 1\nmodel = "cnn"\nscan_batch_sizes = [2, 4]\n')
    argv = ["--config", str(path), "--batch-size", "20", "--train-shards", "data"]
    _, config = parse_command_line(argv)
    assert config.batch_size == 20  # the flag wins
    assert config.lr == 1.0 and config.model == "cnn" and config.scan_batch_sizes == (2, 4)


def test_yaml_file_and_unknown_keys(tmp_path):
    pytest.importorskip("yaml")
    good = tmp_path / "run.yaml"
    good.write_text("epochs: 3\nwarmup_steps: null\n")
    assert read_config_file(good) == {"epochs": 3, "warmup_steps": None}
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_sise = 3\n")
    with pytest.raises(ValueError, match="unknown option 'batch_sise'"):
        read_config_file(bad)
    wrong_type = tmp_path / "wrong.toml"
    wrong_type.write_text('epochs = "three"\n')
    with pytest.raises(ValueError, match="epochs must be int"):
        read_config_file(wrong_type)


def test_stored_config_round_trips():
    config = TrainConfig(train_shards="x", batch_size=7, probe_batches=(1, 3), warmup_steps=None)
    assert TrainConfig.from_dict(config.to_dict()) == config
