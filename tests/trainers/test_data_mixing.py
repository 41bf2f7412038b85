"""The trainer's mix of datasets: repeated --train-shards, A::B, --train-weights, config files."""

from __future__ import annotations

import pytest

from pipeline import Source
from tests.trainers.conftest import base_args, read_rows
from trainers.config import parse_command_line
from trainers.data import train_source
from trainers.train import main


def test_repeated_train_shards_with_weights_make_a_mix():
    _, config = parse_command_line(
        ["--train-shards", "data/web", "--train-shards=s3://b/curated/manifest.json"]
        + ["--train-weights", "0.7,0.3", "--train-epoch-samples", "1000"]
    )
    assert config.data.train_shards == "data/web::s3://b/curated/manifest.json"
    assert train_source(config) == [
        Source("data/web", weight=0.7, name="web"),
        Source("s3://b/curated/manifest.json", weight=0.3, name="curated"),
    ]
    assert config.data.train_epoch_samples == 1000


def test_open_clip_form_without_weights_reads_each_dataset_once_an_epoch():
    _, config = parse_command_line(["--train-shards", "a/out::b/out::http://[::1]:9/c"])
    assert train_source(config) == [
        Source("a/out", repeat=1, name="out1"),
        Source("b/out", repeat=1, name="out2"),
        Source("http://[::1]:9/c", repeat=1, name="c"),
    ]
    _, single = parse_command_line(["--train-shards", "data/web"])
    assert train_source(single) == "data/web"


def test_a_config_file_lists_the_datasets_and_their_weights(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('train-shards = ["data/web", "data/curated"]\ntrain-weights = [3, 1]\n')
    _, config = parse_command_line(["--config", str(path)])
    assert [s.weight for s in train_source(config)] == [3.0, 1.0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--train-shards", "a::b", "--train-weights", "1"], "1 weights for 2"),
        (["--train-shards", "a::b", "--train-weights", "1,0"], "must all be above 0"),
        (["--train-shards", "a::b", "--train-epoch-samples", "9"], "give one of them with it"),
        (
            ["--train-shards", "a::b", "--train-weights", "1,1", "--resampled"],
            "--resampled draws from one dataset",
        ),
    ],
)
def test_mix_flags_that_do_not_fit_are_one_usage_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_command_line(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_weighted_mix_trains_and_logs_each_sources_samples(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = base_args(train_shards, run_dir, epochs=1, val_shards=str(train_shards))
    at = args.index("--train-shards")
    args[at + 1 : at + 2] = [f"{train_shards}::{train_shards}"]
    args += ["--train-weights", "3,1", "--train-epoch-samples", "320"]
    assert main(args) == 0
    assert sum(row["images_per_s"] > 0 for row in read_rows(run_dir, "train")) > 0
    err = capsys.readouterr().err
    assert "mixing 2 sources, 320 samples an epoch" in err
    assert "epoch sources: shards1 240 samples" in err and "shards2 80 samples" in err
