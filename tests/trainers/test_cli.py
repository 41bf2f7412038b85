"""`train` as a user meets it: one-line errors before any work, `--version`, help on every flag.

The mistakes run through `main([...])` with the loader factory replaced by one
that fails the test if called: each mistake must be found before any loader is
built (and before the overlap check, which needs the loaders). The console
script is run in subprocesses for the same exit codes and single stderr line.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainers.data
from shards.flags import default_values, flag_specs
from tests.trainers.conftest import REPO, subprocess_env
from trainers.config import COMMANDS, TrainConfig, build_parser
from trainers.train import main

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def dataset(tmp_path) -> Path:
    """A directory with a manifest.json: enough for every check made before the loaders."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    return root


@pytest.fixture
def no_loaders(monkeypatch):
    """Fail the test if a loader is built: the mistake was found too late."""

    def refuse(*args, **kwargs):
        raise AssertionError("a loader was built before the mistake was reported")

    monkeypatch.setattr(trainers.data, "resolve_config_source", refuse)


def run_main(capsys, args: list[str]) -> tuple[int, list[str]]:
    code = main(["--no-progress", "--no-tensorboard", "--model", "cnn", "--device", "cpu", *args])
    return code, capsys.readouterr().err.splitlines()


def assert_one_error_line(lines: list[str], *fragments: str) -> None:
    assert len(lines) == 1, lines  # once: not logged and printed both
    assert lines[0].startswith("train: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_train_shards_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--device", "cpu"])
    assert stop.value.code == 2  # argparse's code for a missing required flag
    assert_one_error_line(capsys.readouterr().err.splitlines(), "--train-shards", "required")
    with pytest.raises(SystemExit) as stop:
        main(["scan-throughput", "--scan-source", "loader"])  # the probe that reads shards
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train scan-throughput: error: ")
    assert "--train-shards" in lines[0]


def test_train_shards_from_a_config_file_is_enough(tmp_path, dataset, no_loaders, capsys):
    path = tmp_path / "run.toml"
    path.write_text(f'train-shards = "{dataset}"\nmodel = "nope"\n')
    code = main(["--config", str(path), "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    assert code == 1  # past the parser: the required flag came from the file
    assert "unknown model 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config_text", "fragment"),
    [(None, "No such file"), ("epochs = [", "not valid TOML"), ("bogus = 1", "unknown option")],
)
def test_config_file_mistakes_are_usage_errors(tmp_path, capsys, config_text, fragment):
    path = tmp_path / "run.toml"
    if config_text is not None:
        path.write_text(config_text)
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(path)])
    assert stop.value.code == 2
    assert_one_error_line(capsys.readouterr().err.splitlines(), str(path), fragment)


def test_unknown_flag_and_bad_value_are_one_line(capsys):
    for args, fragment in [(["--bogus"], "--bogus"), (["--batch-size", "0"], "at least 1")]:
        with pytest.raises(SystemExit) as stop:
            main(["--train-shards", "x", *args])
        assert stop.value.code == 2
        assert_one_error_line(capsys.readouterr().err.splitlines(), fragment, "train --help")


def test_missing_paths_say_they_do_not_exist(tmp_path, no_loaders, capsys):
    run_dir = tmp_path / "run"
    cases = [
        (str(tmp_path / "nope"), ["does not exist", str(tmp_path / "nope")]),
        (str(tmp_path / "nope" / "manifest.json"), ["does not exist"]),
        (str(tmp_path / "train-{000000..000003}.tar"), ["none of its 4 shard files exist"]),
        (str(tmp_path), ["holds no manifest.json"]),
    ]
    for source, fragments in cases:
        code, lines = run_main(capsys, ["--train-shards", source, "--run-dir", str(run_dir)])
        assert code == 1
        assert_one_error_line(lines, "--train-shards", *fragments)
        assert "cannot tell the shard format" not in lines[0]
    code, lines = run_main(
        capsys,
        ["--train-shards", str(tmp_path), "--val-shards", str(tmp_path / "v.tar")]
        + ["--run-dir", str(run_dir)],
    )
    assert code == 1 and "holds no manifest.json" in lines[0]  # train is checked first
    assert not run_dir.exists()  # nothing was made


def write_used_run(run_dir: Path) -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    return run_dir


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("model", ["unknown model 'nope'", "built-in models are"]),
        ("library", ["unknown model library 'keras'", "timm:NAME"]),
        ("run_dir_file", ["is a file, not a directory", "pick another --run-dir"]),
        ("run_dir_under_file", ["cannot be made", "is a file"]),
        ("used_run_dir", ["already holds a run", "--resume auto"]),
        ("resume_missing", ["no such checkpoint", "--resume auto"]),
        ("fp16_on_cpu", ["--amp fp16 needs CUDA", "--amp bf16"]),
    ],
)
def test_user_mistakes_stop_before_any_loader(
    tmp_path, dataset, no_loaders, capsys, case, fragments
):
    run_dir = tmp_path / "run"
    extra: list[str] = []
    if case == "model":
        extra = ["--model", "nope"]
    elif case == "library":
        extra = ["--model", "keras:resnet"]
    elif case == "run_dir_file":
        run_dir.write_text("not a directory")
    elif case == "run_dir_under_file":
        (tmp_path / "file").write_text("x")
        run_dir = tmp_path / "file" / "run"
    elif case == "used_run_dir":
        write_used_run(run_dir)
    elif case == "resume_missing":
        extra = ["--resume", str(tmp_path / "step-000000001.pt")]
    elif case == "fp16_on_cpu":
        extra = ["--amp", "fp16"]
    code, lines = run_main(
        capsys, ["--train-shards", str(dataset), "--run-dir", str(run_dir), *extra]
    )
    assert code == 1
    assert_one_error_line(lines, *fragments)
    if case in ("model", "library", "resume_missing", "fp16_on_cpu"):
        assert not run_dir.exists()


def test_probes_may_write_into_a_used_run_dir(tmp_path, dataset, no_loaders, capsys):
    """find-batch-size reports into --run-dir beside a run: only `train` refuses a used one."""
    run_dir = write_used_run(tmp_path / "run")
    argv = ["find-batch-size", "--train-shards", str(dataset), "--run-dir", str(run_dir)]
    argv += ["--device", "cpu", "--model", "nope"]
    assert main(argv) == 1
    assert "unknown model" in capsys.readouterr().err  # got past the run-dir check


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")
def test_device_cuda_without_cuda(tmp_path, dataset, no_loaders, capsys):
    argv = ["--train-shards", str(dataset), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--device", "cuda"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert_one_error_line(lines, "--device cuda", "CUDA is not available", "use --device cpu")
    assert not (tmp_path / "run").exists()


def test_data_source_errors_are_one_line_and_make_no_run_dir(tmp_path, dataset, capsys):
    """A ManifestError or ValueError from resolving the source: exit 1, named, no traceback."""
    run_dir = tmp_path / "run"
    (dataset / "manifest.json").write_text('{"version": ')  # torn JSON: a ManifestError
    code, lines = run_main(capsys, ["--train-shards", str(dataset), "--run-dir", str(run_dir)])
    assert code == 1
    assert_one_error_line(lines, str(dataset / "manifest.json"), "not valid JSON")
    (tmp_path / "a.tar").write_bytes(b"")
    (tmp_path / "a.parquet").write_bytes(b"")
    source = str(tmp_path / "a.{tar,parquet}")  # one tar, one Parquet: a ValueError
    code, lines = run_main(capsys, ["--train-shards", source, "--run-dir", str(run_dir)])
    assert code == 1
    assert_one_error_line(lines, "--train-shards", "mix formats")
    assert not run_dir.exists()


def test_a_bug_keeps_its_traceback(tmp_path, dataset, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("a bug in our code")

    monkeypatch.setattr(trainers.data, "resolve_config_source", broken)
    with pytest.raises(TypeError, match="a bug in our code"):
        main(["--train-shards", str(dataset), "--device", "cpu", "--run-dir", str(tmp_path / "r")])


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardpipe {importlib.metadata.version('shardpipe')}"


def option_help(text: str) -> dict[str, str]:
    """`{invocation: help}` of every option in an argparse help text."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (-\S.*?)(?: {2,}(\S.*))?$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2) or ""
        elif current is not None and line.startswith("   "):
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_a_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    entries = option_help(build_parser(command, default_values(TrainConfig)).format_help())
    # One per flag the generator makes (the loader's groups walked) + --help, --version, --config.
    assert len(entries) == len(list(flag_specs(TrainConfig))) + 3
    for invocation, text in entries.items():
        assert text, f"{invocation} has no help"
        if not invocation.startswith(("-h", "--version")):
            assert "default" in text, f"{invocation} shows no default: {text!r}"
        assert "(default: None)" not in text, f"{invocation}: say what None means"


def console_command(args: list[str]) -> list[str]:
    script = Path(sys.executable).with_name("train")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "trainers.train", *args]  # not pip-installed: same main()


@pytest.mark.timeout(180)
def test_console_script_mistakes(tmp_path):
    """The installed script: exit codes and one stderr line, no traceback (run in parallel)."""
    run_dir = str(tmp_path / "run")
    cases = [
        (["--device", "cpu"], 2, "--train-shards"),
        (["--train-shards", str(tmp_path / "nope"), "--run-dir", run_dir], 1, "does not exist"),
        (["--version"], 0, None),
    ]
    if NO_CUDA:
        (tmp_path / "manifest.json").write_text(json.dumps({}))
        args = ["--train-shards", str(tmp_path), "--device", "cuda", "--run-dir", run_dir]
        cases.append((args, 1, "use --device cpu"))
    started = [
        subprocess.Popen(
            console_command(args),
            cwd=REPO,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, _, _ in cases
    ]
    for process, (args, code, fragment) in zip(started, cases, strict=True):
        out, err = process.communicate(timeout=150)
        assert process.returncode == code, (args, err)
        assert "Traceback" not in err
        if fragment is None:
            assert out.startswith("shardpipe ") and err == ""
        else:
            lines = err.splitlines()
            assert len(lines) == 1 and fragment in lines[0], err
