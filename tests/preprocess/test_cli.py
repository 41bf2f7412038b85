"""`preprocess` as a user meets it: one-line mistakes, `--version`, progress, a rerun with nothing to do.

Mistakes run through `main([...])` with Ray replaced by a function that fails
the test if called: each must be reported before Ray would start. The Ray
start-up step is checked once through the installed console script.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import preprocess.job
from preprocess.cli import main, setup_logging
from preprocess.progress import ProgressLine, progress_bar
from preprocess.sample import make_sample

BUILD = ["build-shards", "--image-size", "48", "--shard-size", "16", "--no-progress"]


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if Ray is started: the mistake (or the rerun) should not need it."""

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(preprocess.job, "start_ray", refuse)
    monkeypatch.setattr(preprocess.job, "iter_ray", refuse)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "images"
    make_sample(root, 48, classes=3, seed=1, workers=1)
    return root


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def one_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err  # printed once, no traceback
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "required: COMMAND"),
        (["build-shards", "--output", "o"], "--input"),
        (
            ["build-shards", "--input", "i", "--output", "o", "--quality", "300"],
            "--quality must be in 1..100, got 300",
        ),
        (["build-shards", "--input", "i", "--output", "o", "--formats", "tar,zip"], "--formats"),
        (["build-shards", "--input", "i", "--output", "o", "--shard-bytes", "lots"], "lots"),
        (
            ["build-shards", "--input", "i", "--output", "o"]
            + ["--shard-size", "5", "--shard-bytes", "1MB"],
            "not allowed with",
        ),
        (["make-sample", "--output", "o", "--count", "0"], "--count"),
        (["verify"], "source"),
        (["info", "d", "--bogus"], "--bogus"),
    ],
)
def test_usage_mistakes_exit_2_with_one_line(args, fragment, capsys, no_ray):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    line = one_line(capsys)
    assert line.startswith("preprocess") and ": error: " in line and fragment in line
    assert "--help" in line  # says where to look next


def test_data_mistakes_exit_1_with_one_line_before_ray(tmp_path, images, capsys, no_ray):
    out = tmp_path / "out"
    assert main([*BUILD, "--input", str(tmp_path / "nope"), "--output", str(out)]) == 1
    assert "does not exist" in one_line(capsys)
    assert not out.exists()
    assert main(["verify", str(tmp_path / "nope")]) == 1
    assert one_line(capsys).startswith("preprocess verify: FAILED: no such file or directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty)]) == 1
    line = one_line(capsys)
    assert "no manifest at" in line and "no *.tar or *.parquet shard files" in line
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text('{"version": 2}')
    assert main(["info", str(bad)]) == 1
    assert "not a shardpipe manifest" in one_line(capsys)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main([*BUILD, "--input", str(images), "--output", str(busy)]) == 1
    assert "not empty and holds no shard build" in one_line(capsys)


def test_output_with_another_build_is_refused_before_ray(tmp_path, images, capsys, no_ray):
    out = tmp_path / "out"
    assert main([*BUILD, "--executor", "inline", "--input", str(images), "--output", str(out)]) == 0
    capsys.readouterr()
    assert main([*BUILD, "--input", str(images), "--output", str(out), "--quality", "80"]) == 1
    err = capsys.readouterr().err
    assert "holds a build with other options" in err and "quality: 90 -> 80" in err
    assert err.count("holds a build") == 1 and "Traceback" not in err


def test_a_bug_keeps_its_traceback(tmp_path, images, monkeypatch):
    def broken(config):
        raise TypeError("a bug in our code")

    monkeypatch.setattr(preprocess.job, "run_build", broken)
    with pytest.raises(TypeError, match="a bug in our code"):
        main([*BUILD, "--input", str(images), "--output", str(tmp_path / "out")])


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardpipe {importlib.metadata.version('shardpipe')}"


def test_rerun_with_nothing_to_do_starts_no_ray_and_changes_no_byte(
    tmp_path, images, capsys, no_ray
):
    out = tmp_path / "out"
    args = [*BUILD, "--input", str(images), "--output", str(out)]
    assert main([*args, "--executor", "inline"]) == 0
    first = capsys.readouterr().out
    assert "shards built 3, reused 0" in first
    before = tree_digest(out)
    assert main(args) == 0  # --executor ray: nothing to build, so Ray is never started
    summary = capsys.readouterr().out
    assert "nothing to do: 3 shards reused" in summary
    assert "images/s" not in summary
    assert tree_digest(out) == before


def test_a_rerun_builds_only_the_shard_whose_marker_is_gone(tmp_path, images, capsys, no_ray):
    out = tmp_path / "out"
    args = [*BUILD, "--executor", "inline", "--input", str(images), "--output", str(out)]
    assert main(args) == 0
    before = tree_digest(out)
    (out / "_build" / "train-000001.json").unlink()
    assert main(args) == 0
    assert "shards built 1, reused 2" in capsys.readouterr().out
    assert tree_digest(out) == before


def test_without_a_terminal_progress_is_plain_lines(capsys):
    with progress_bar(100, True, initial=10, every_s=0.0) as progress:
        assert isinstance(progress, ProgressLine)
        progress.update(40)
        progress.update(50)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines()[0].startswith("build-shards: 50 of 100 images (50%), ")
    assert err.splitlines()[1].startswith("build-shards: 100 of 100 images (100%), ")
    with progress_bar(100, False) as progress:
        progress.update(100)
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_log_lines_go_above_the_bar(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    setup_logging()
    log = logging.getLogger("preprocess.test")
    with progress_bar(100, True) as bar:
        bar.update(30)
        log.info("a line while the bar is shown")
        bar.update(70)
    log.info("after the bar")
    text = terminal.getvalue()
    assert "\rbuild-shards:" in text  # a bar, redrawn in place
    # tqdm.write clears the bar first: the log line is a line of its own, not inside a frame.
    assert "\na line while the bar is shown\n" in text.replace("\r", "\n")
    assert text.endswith("after the bar\n")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_console_script_shows_starting_ray_as_one_step(tmp_path, images):
    script = shutil.which("preprocess", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the `preprocess` console script is not installed (pip install -e .)")
    out = tmp_path / "out"
    command = [script, *BUILD[:-1], "--workers", "1", "--executor", "ray"]
    command += ["--input", str(images), "--output", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "starting Ray (local, 1 CPUs) ..."
    assert lines[1].startswith("Ray started in ") and lines[1].endswith(" s")
    assert "Token authentication" not in result.stderr and "\r" not in result.stderr
    assert "shards built 3, reused 0" in result.stdout
