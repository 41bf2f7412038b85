"""TrainConfig: flags generated from its groups, config files as defaults, each group checking
itself, and the stored round trip (also of a config stored before the groups)."""

from __future__ import annotations

import dataclasses

import pytest

from shards.flags import flag_specs
from trainers.config import (
    Checkpointing,
    Data,
    Model,
    Optimization,
    Probes,
    Recipe,
    Runtime,
    Schedule,
    TrainConfig,
    parse_command_line,
    read_config_file,
)


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
    assert config.schedule.batch_size == 8 and config.schedule.accum_steps == 4
    assert (
        config.run.amp == "bf16"
        and config.run.progress is False
        and config.model.channels_last is True
    )
    assert config.schedule.warmup_steps == 5 and config.probe.probe_batches == (2, 4, 16)
    assert config.schedule.lr == 0.2 and isinstance(config.schedule.lr, float)


def test_subcommands_take_the_same_flags():
    command, config = parse_command_line(["scan-throughput", "--scan-batch-sizes", "4,8"])
    assert command == "scan-throughput" and config.probe.scan_batch_sizes == (4, 8)
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
    assert config.schedule.batch_size == 20  # the flag wins
    assert (
        config.schedule.lr == 1.0
        and config.model.model == "cnn"
        and config.probe.scan_batch_sizes == (2, 4)
    )


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
    config = TrainConfig(
        data=Data(train_shards="x"),
        schedule=Schedule(batch_size=7, warmup_steps=None),
        probe=Probes(probe_batches=(1, 3)),
    )
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["schedule"]["batch_size"] == 7  # one mapping per group


def test_a_config_stored_before_the_groups_reads_into_them():
    """`RUN_DIR/config.json` and checkpoints of earlier runs hold the fields at the top."""
    config = TrainConfig(
        data=Data(train_shards="x", task="single-label"),
        model=Model(model="cnn"),
        schedule=Schedule(batch_size=7, lr=0.2),
        optimizer=Optimization(optimizer="adamw"),
        recipe=Recipe(mixup=0.2, label_smoothing=0.1),
        checkpoint=Checkpointing(keep_checkpoints=2),
    )
    flat = {}
    for name, group in config.to_dict().items():
        if name in ("loader", "recipe"):  # groups before, too (`label_smoothing` sat beside)
            flat[name] = dict(group)
        else:
            flat.update(group)
    flat["label_smoothing"] = flat["recipe"].pop("label_smoothing")
    assert "batch_size" in flat and flat["model"] == "cnn" and flat["optimizer"] == "adamw"
    assert TrainConfig.from_dict(flat) == config
    with pytest.raises(ValueError, match="unknown option 'batch_sise'"):
        TrainConfig.from_dict({**flat, "batch_sise": 3})


@pytest.mark.parametrize(
    ("group", "options", "named"),
    [
        (Data, dict(overlap_check="all"), "Data.overlap_check 'all' is not one of keys"),
        (Data, dict(train_split=""), "Data.train_split must be a split name"),
        (Data, dict(train_shards="a::b", train_weights=(1.0,)), "gives 1 weights for 2"),
        (Data, dict(task="multi-label", label_field="cls"), "--label-field cls does not hold"),
        (Model, dict(num_classes=0), "Model.num_classes must be at least 1, got 0"),
        (Model, dict(sync_bn="yes"), "Model.sync_bn must be True or False"),
        (Schedule, dict(batch_size=0), "Schedule.batch_size must be at least 1, got 0"),
        (Schedule, dict(epochs=2.5), "Schedule.epochs must be an integer"),
        (Schedule, dict(lr=0.1, min_lr=0.2), "Schedule.min_lr must be at most lr (0.1), got 0.2"),
        (Schedule, dict(warmup_ratio=1.0), "Schedule.warmup_ratio must be a number in [0, 1)"),
        (Schedule, dict(max_steps=0), "Schedule.max_steps must be at least 1"),
        (Optimization, dict(optimizer="lamb"), "'lamb' is not one of sgd, adamw"),
        (Optimization, dict(weight_decay=-1), "Optimization.weight_decay must be at least 0"),
        (Runtime, dict(amp="fp8"), "Runtime.amp 'fp8' is not one of off, bf16, fp16"),
        (Runtime, dict(log_every=0), "Runtime.log_every must be at least 1"),
        (Runtime, dict(seed=-1), "Runtime.seed must be at least 0"),
        (Checkpointing, dict(keep_checkpoints=0), "Checkpointing.keep_checkpoints must be at"),
        (Checkpointing, dict(checkpoint_every=-1), "Checkpointing.checkpoint_every must be at"),
        (Probes, dict(memory_fraction=0), "Probes.memory_fraction must be a number in (0, 1]"),
        (Probes, dict(probe_batches=(8, 8)), "needs at least two different batch sizes"),
        (Probes, dict(scan_batch_sizes=(0, 8)), "Probes.scan_batch_sizes must be batch sizes"),
        (Recipe, dict(label_smoothing=1.0), "Recipe.label_smoothing must be a number in [0, 1)"),
        (TrainConfig, dict(schedule=Data()), "TrainConfig.schedule must be a Schedule"),
    ],
)
def test_every_group_refuses_a_bad_value_naming_the_field(group, options, named):
    with pytest.raises(ValueError) as refused:
        group(**options)
    assert named in str(refused.value)


def test_checks_across_groups_stay_on_the_config():
    with pytest.raises(ValueError, match="--smoothing is for single-label training"):
        TrainConfig(data=Data(task="multi-label"), recipe=Recipe(label_smoothing=0.1))
    with pytest.raises(ValueError, match="--batch-size must be even, got 15"):
        TrainConfig(schedule=Schedule(batch_size=15), recipe=Recipe(mixup=1, mixup_mode="pair"))
    with pytest.raises(ValueError, match="leave --aug-repeats at 1"):
        TrainConfig(data=Data(train_shards="a::b"), recipe=Recipe(aug_repeats=2))


def test_a_group_refusal_on_the_command_line_names_the_flag(capsys):
    for argv, line in [
        (["--min-lr", "1", "--lr", "0.5"], "--min-lr must be at most lr (0.5), got 1.0"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1, got 0"),
        (["--memory-fraction", "2"], "--memory-fraction must be a number in (0, 1], got 2.0"),
    ]:
        with pytest.raises(SystemExit):
            parse_command_line(["--train-shards", "d", *argv])
        assert line in capsys.readouterr().err


def test_every_field_of_every_group_is_one_flag_of_its_own_name():
    """The groups changed no flag: each keeps the name it had as a top-level field."""
    dests = [spec.dest for spec in flag_specs(TrainConfig)]
    assert len(dests) == len(set(dests))
    renamed = {"label_smoothing": "smoothing", "channels_last": "channels_last"}
    for group in (Data, Model, Schedule, Optimization, Runtime, Checkpointing, Probes):
        for field in dataclasses.fields(group):
            assert renamed.get(field.name, field.name) in dests, field.name
