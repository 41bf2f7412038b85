"""One root error class: every error of ours is a `ShardpipeError` of the right kind, and the
command lines tell our errors (one line) from bugs (a traceback) by type alone.

Kinds: `DataError` (the input data cannot be used), `UsageError` (a setting or request
that cannot be honoured), or the root itself for `BuildError` (a build that cannot go on
for either reason). Exit codes: 2 for a command line refused before anything runs, 1 for
our error while the command runs, a traceback for anything else.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.cli
import preprocess.cli
import shards.manifest
import trainers.data
import trainers.train
from pipeline.sources import resolve_source
from shards.errors import DataError, ShardpipeError, UsageError
from shards.manifest import (
    FormatNotBuiltError,
    ManifestError,
    SplitNotFoundError,
    read_manifest,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shards", "pipeline", "preprocess", "trainers")

# Every exception class of ours, by name: its kind and the builtin base it keeps, so code
# that caught the builtin before still catches it. A new class must be added here.
KINDS: dict[str, tuple[type, type | None]] = {
    "ShardError": (DataError, None),
    "SampleError": (DataError, None),
    "ManifestError": (DataError, ValueError),
    "SplitNotFoundError": (ManifestError, KeyError),
    "FormatNotBuiltError": (ManifestError, KeyError),
    "ManifestNotFoundError": (DataError, FileNotFoundError),  # no manifest where one was asked
    "ShardReadError": (DataError, OSError),
    "ObjectNotFoundError": (DataError, OSError),
    "ObjectChangedError": (DataError, OSError),
    "NotRegularFileError": (DataError, OSError),
    "LoaderDataError": (DataError, RuntimeError),
    "LabelReadError": (DataError, RuntimeError),
    "UnreadableSourceError": (DataError, ValueError),
    "VerifyError": (DataError, None),
    "InputError": (DataError, ValueError),
    "PlanError": (DataError, ValueError),
    "NonFiniteLossError": (DataError, RuntimeError),
    "CheckpointError": (DataError, RuntimeError),
    "SettingError": (UsageError, ValueError),
    "ModelError": (UsageError, ValueError),
    "RunDirError": (UsageError, RuntimeError),
    "DeviceError": (UsageError, RuntimeError),
    "BuildError": (ShardpipeError, RuntimeError),
    "ClusterError": (ShardpipeError, RuntimeError),  # no Ray cluster, or no room on it
    "ChannelError": (ShardpipeError, ConnectionError),  # a remote role's batch channel broke
    "CacheBypass": (DataError, None),  # the shard cache's files cannot be used as found
    "_Unfit": (DataError, None),  # a name in the cache is not what it made; stays inside
    "ByteSizeError": (UsageError, ValueError),  # a text that is not a byte size
    "PolicyError": (UsageError, ValueError),  # an auto_augment string outside the grammar
    "OpFailed": (UsageError, ValueError),  # an augmentation op raised; the loader names it
    "_NotAHeader": (DataError, None),  # Parquet page header bytes; stays inside
    "LoaderStateError": (DataError, ValueError),  # a resume state of no point of this epoch
    "MissingFieldError": (UsageError, None),  # a field no sample of the first shard holds
}
# The root and its two kinds, one signal that never leaves `shards.storage` (an HTTP
# status worth retrying, raised and caught inside one request), and a warning (a setting's
# spelling kept for one release), which is no error.
NOT_LISTED = {"ShardpipeError", "DataError", "UsageError", "RetryableStatus", "OldSpellingWarning"}


def our_exception_classes() -> dict[str, type]:
    """Every exception class defined in our four packages, by name."""
    found: dict[str, type] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if (
                    inspect.isclass(value)
                    and issubclass(value, BaseException)
                    and value.__module__ == module.__name__
                ):
                    assert value.__name__ not in found, f"two error classes named {value}"
                    found[value.__name__] = value
    return found


def test_every_error_class_has_the_root_and_its_kind():
    classes = our_exception_classes()
    unlisted = sorted(set(classes) - set(KINDS) - NOT_LISTED)
    assert not unlisted, f"add {unlisted} to KINDS with its kind (DataError or UsageError)"
    assert set(KINDS) <= set(classes), sorted(set(KINDS) - set(classes))
    for name, (kind, builtin) in KINDS.items():
        cls = classes[name]
        assert issubclass(cls, kind), f"{name} is not a {kind.__name__}"
        assert issubclass(cls, ShardpipeError), name
        assert not issubclass(cls, DataError) or not issubclass(cls, UsageError), name
        if builtin is not None:
            assert issubclass(cls, builtin), f"{name} no longer is a {builtin.__name__}"
    assert issubclass(UsageError, ValueError) and not issubclass(DataError, ValueError)


def assert_one_line(err: str, *fragments: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# A missing split or format


def test_a_missing_split_names_the_manifest_file_and_its_splits(built_shards):
    path = built_shards.output / "manifest.json"
    manifest = read_manifest(path)
    with pytest.raises(SplitNotFoundError) as caught:
        manifest.shard_table("test", "tar")
    message = str(caught.value)
    assert str(path) in message and "split 'test' not in manifest" in message
    assert "['train', 'val']" in message
    assert isinstance(caught.value, KeyError)  # what a missing split always was
    with pytest.raises(FormatNotBuiltError, match=r"format 'zip' not built.*\['tar', 'parquet'\]"):
        manifest.shard_table("train", "zip")
    with pytest.raises(SplitNotFoundError, match=str(path)):
        resolve_source(built_shards.output, "test")  # the dataset directory: its manifest


def test_a_manifest_made_in_memory_still_says_what_it_is(built_shards):
    manifest = read_manifest(built_shards.output / "manifest.json")
    bare = shards.manifest.Manifest(
        manifest.classes,
        manifest.image_field,
        manifest.formats,
        manifest.splits,
        manifest.config,
        manifest.inputs,
        manifest.skipped,
        layout=manifest.layout,
        fields=manifest.fields,
    )
    assert bare == manifest  # where it came from is not part of what it is
    with pytest.raises(SplitNotFoundError, match=r"^manifest: splits: split 'test'"):
        bare.shard_table("test")


# preprocess


def test_preprocess_prints_one_line_for_our_data_error(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text('{"version": ')  # torn: a ManifestError
    assert preprocess.cli.main(["info", str(tmp_path)]) == 1
    assert_one_line(capsys.readouterr().err, "preprocess info: error: ", "not valid JSON")


def test_preprocess_usage_error_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        preprocess.cli.main(["make-sample", "--output", str(tmp_path / "s"), "--count", "0"])
    assert stop.value.code == 2
    assert_one_line(capsys.readouterr().err, "--count must be at least 1")


@pytest.mark.parametrize("bug", [ValueError, KeyError, TypeError])
def test_preprocess_bug_keeps_its_traceback(built_shards, monkeypatch, bug):
    """A `ValueError` from a bug was a one-line error before; now only ours are."""

    def broken(*args, **kwargs):
        raise bug("a bug in our code")

    monkeypatch.setattr(shards.manifest, "read_manifest", broken)
    with pytest.raises(bug, match="a bug in our code"):
        preprocess.cli.main(["info", str(built_shards.output)])


def test_preprocess_bug_prints_a_traceback_from_the_console(tmp_path):
    script = (
        "import sys, shards.manifest, preprocess.cli\n"
        "def broken(*args, **kwargs):\n"
        "    raise KeyError('a bug in our code')\n"
        "shards.manifest.read_manifest = broken\n"
        f"sys.exit(preprocess.cli.main(['info', {str(tmp_path)!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr
    assert "KeyError: 'a bug in our code'" in done.stderr


def test_preprocess_our_error_from_a_command_body_is_one_line(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise UsageError("asked for what cannot be done; do this instead")

    monkeypatch.setattr(shards.manifest, "read_manifest", refuse)
    assert preprocess.cli.main(["info", str(tmp_path)]) == 1
    assert_one_line(capsys.readouterr().err, "preprocess info: error: asked for what")


# pipeline


def test_pipeline_missing_split_is_one_line_naming_the_file(built_shards, capsys):
    args = ["inspect-shuffle", str(built_shards.output), "--split", "test", "--no-search"]
    assert pipeline.cli.main(args) == 1
    line = assert_one_line(capsys.readouterr().err, "pipeline inspect-shuffle: error: ")
    assert str(built_shards.output / "manifest.json") in line and "['train', 'val']" in line


def test_pipeline_usage_error_exits_2(capsys):
    # One trial was a plain ValueError from inside the command (an ideal shuffle's
    # spread needs two); now the option refuses it, naming the flag.
    with pytest.raises(SystemExit) as stop:
        pipeline.cli.main(["inspect-shuffle", "d", "--trials", "1"])
    assert stop.value.code == 2
    assert_one_line(capsys.readouterr().err, "--trials must be at least 2, got 1")


def test_an_options_check_that_raises_a_plain_value_error_is_a_bug(monkeypatch):
    """Only `UsageError` from an options check is the command line's fault (exit 2)."""

    def broken(self):
        raise ValueError("a bug in our code")

    monkeypatch.setattr(pipeline.cli.InspectShuffleOptions, "__post_init__", broken)
    with pytest.raises(ValueError, match="a bug in our code"):
        pipeline.cli.main(["inspect-shuffle", "d"])


def test_preprocess_bad_fields_entry_is_one_line(tmp_path, capsys):
    argv = ["build-shards", "--input", str(tmp_path), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stop:
        preprocess.cli.main([*argv, "--fields", "caption"])
    assert stop.value.code == 2
    assert_one_line(capsys.readouterr().err, "--fields entry 'caption': write COLUMN:MEMBER")


def test_pipeline_source_of_no_format_is_one_line(tmp_path, capsys):
    assert pipeline.cli.main(["inspect-shuffle", str(tmp_path / "nope")]) == 1
    assert_one_line(capsys.readouterr().err, "pipeline inspect-shuffle: error: cannot tell")


@pytest.mark.parametrize("bug", [ValueError, KeyError, TypeError])
def test_pipeline_bug_keeps_its_traceback(built_shards, monkeypatch, bug):
    import pipeline.shuffle_quality

    def broken(*args, **kwargs):
        raise bug("a bug in our code")

    monkeypatch.setattr(pipeline.shuffle_quality, "inspect_shuffle", broken)
    with pytest.raises(bug, match="a bug in our code"):
        pipeline.cli.main(["inspect-shuffle", str(built_shards.output)])


# train


def train_args(source: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *("--train-shards", str(source), "--run-dir", str(run_dir), "--device", "cpu"),
        *("--model", "cnn", "--no-progress", "--no-tensorboard", *extra),
    ]


def test_train_missing_split_is_one_line_naming_the_file(built_shards, tmp_path, capsys):
    code = trainers.train.main(
        train_args(built_shards.output, tmp_path / "run", "--train-split", "test")
    )
    assert code == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err
    assert str(built_shards.output / "manifest.json") in errors[0]
    assert "split 'test' not in manifest" in errors[0] and "['train', 'val']" in errors[0]


def test_train_usage_error_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        trainers.train.main(train_args(tmp_path, tmp_path / "run", "--batch-size", "0"))
    assert stop.value.code == 2
    assert_one_line(capsys.readouterr().err, "--batch-size", "at least 1")


@pytest.mark.parametrize("bug", [ValueError, KeyError, TypeError])
def test_train_bug_keeps_its_traceback(built_shards, tmp_path, monkeypatch, bug):
    """A bare `KeyError` was turned into a one-line data error before; now it is a bug."""

    def broken(*args, **kwargs):
        raise bug("a bug in our code")

    monkeypatch.setattr(trainers.data, "resolve_config_source", broken)
    with pytest.raises(bug, match="a bug in our code"):
        trainers.train.main(train_args(built_shards.output, tmp_path / "run"))


def test_train_options_check_that_raises_a_plain_value_error_is_a_bug(tmp_path, monkeypatch):
    import trainers.config

    def broken(self):
        raise ValueError("a bug in our code")

    monkeypatch.setattr(trainers.config.TrainConfig, "__post_init__", broken)
    with pytest.raises(ValueError, match="a bug in our code"):
        trainers.train.main(train_args(tmp_path, tmp_path / "run"))
