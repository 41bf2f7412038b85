"""`train` as a user meets it: one-line errors before any work, `--version`, help on every flag.

The mistakes run through `main([...])` with the loader factory replaced by one
that fails the test if called: each mistake must be found before any loader is
built (and before the overlap check, which needs the loaders). The console
script is run in subprocesses for the same exit codes and single stderr line.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import trainers.data
from shards.flags import default_values, flag_specs
from tests.trainers.conftest import REPO, base_args, subprocess_env
from trainers.config import COMMANDS, TrainConfig, build_parser, parse_command_line
from trainers.metrics import PLOT_NAME
from trainers.schedule import BatchPlan, build_schedule
from trainers.train import CONFIG_LINE_WIDTH, config_lines, draw_plot, log_startup, main

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


# The start-up log: short lines, the whole config in the run directory


@pytest.mark.slow
def test_startup_log_is_short_lines_and_the_whole_config_is_in_the_run_dir(
    train_shards, tmp_path, capsys
):
    """It was one line of 1,223 characters (the config dict); now config.json holds it."""
    run_dir = tmp_path / "run"
    argv = base_args(train_shards, run_dir, epochs=1, max_steps=1, batch_size=8, plot=False)
    assert main(argv) == 0
    lines = [
        line.split(" INFO ", 1)[1]
        for line in capsys.readouterr().err.splitlines()
        if " INFO " in line
    ]
    first_batch = next(i for i, line in enumerate(lines) if line.startswith("time to first batch"))
    startup = lines[:first_batch]
    assert len(startup) >= 10, startup
    assert max(len(line) for line in startup) < 200, max(startup, key=len)
    assert (
        f"config: every option in {run_dir / 'config.json'}; changed from the defaults:" in startup
    )
    groups = {line.split(":")[0].strip(): line for line in startup if line.startswith("  ")}
    assert "--batch-size 8 --epochs 1 --max-steps 1" in groups["batch"], groups
    assert "--no-plot" in groups["metrics"] and "--workers 0" in groups["workers"], groups
    assert not any("{'" in line for line in startup)  # no dict repr left in the log
    stored = json.loads((run_dir / "config.json").read_text())
    _, config = parse_command_line(argv)
    assert stored["config"] == config.to_dict()  # every option, resolved
    assert stored["effective_batch"] == 8


def test_every_startup_line_is_short_for_a_run_of_many_options(trainer_log):
    """`log_startup` on a run with long paths and many changed options (no data read)."""
    source = "/data/" + "long-directory-name/" * 6 + "manifest.json"
    argv = ["--train-shards", source, "--run-dir", "/runs/" + "deep/" * 12, "--batch-size", "96"]
    argv += ["--accum-steps", "3", "--epochs", "90", "--lr", "0.8", "--warmup-steps", "1234"]
    argv += ["--amp", "bf16", "--workers", "7", "--clip-grad", "1.5", "--seed", "123456"]
    _, config = parse_command_line(argv)
    plan = BatchPlan(96, 3, 64, 12_345, 90)
    schedule = build_schedule(plan, 0.8, 256, "linear", 0.0, 0.05, 1234)
    source_info = SimpleNamespace(
        total_samples=1_281_167, shards=[None] * 1024, manifest_url=source, names=("",)
    )
    run = SimpleNamespace(
        config=config,
        plan=plan,
        schedule=schedule,
        info=SimpleNamespace(world_size=64, device="cuda:0"),
        feed=SimpleNamespace(
            loaders=SimpleNamespace(train=SimpleNamespace(source=source_info), val=None, classes=[])
        ),
        identity={"num_classes": 1000},
        learner=SimpleNamespace(module=torch.nn.Linear(4, 2)),
        state=SimpleNamespace(step=4567, epoch=3),
    )
    log_startup(run)
    lines = trainer_log.messages
    assert len(lines) >= 15 and lines[0].startswith("config: every option in /runs/deep/")
    assert max(len(line) for line in lines) < 200, max(lines, key=len)
    assert any(line.startswith("  batch: --batch-size 96 --accum-steps 3") for line in lines)
    assert "batch: 96 per device x 3 accumulation x 64 ranks = effective batch 18432" in lines
    assert lines[-1] == f"resumed at step 4567 of {plan.total_steps}, epoch 3"


def test_changed_options_wrap_into_short_lines_per_group():
    secret_source = "s3://key:secret@bucket/" + "d" * 150 + "/manifest.json"
    argv = ["--train-shards", secret_source, "--batch-size", "8", "--epochs", "3", "--lr", "0.5"]
    argv += ["--no-progress", "--channels-last", "--probe-batches", "2,4,8", "--workers", "3"]
    argv += ["--image-size", "96", "--shuffle-buffer", "64", "--seed", "7", "--amp", "bf16"]
    _, config = parse_command_line(argv)
    lines = config_lines(config)
    assert (
        lines[0]
        == f"config: every option in {config.run.run_dir}/config.json; changed from the defaults:"
    )
    assert all(len(line) <= CONFIG_LINE_WIDTH for line in lines), lines
    text = " ".join(lines)
    assert "secret" not in text and "s3://***@bucket/ddd" in text  # redacted, shortened
    for flag in (
        "--batch-size 8",
        "--epochs 3",
        "--lr 0.5",
        "--no-progress",
        "--channels-last",
        "--probe-batches 2,4,8",
        "--workers 3",
        "--image-size 96",
        "--amp bf16",
    ):
        assert text.count(flag) == 1, flag
    assert "--model" not in text  # at its default
    assert config_lines(TrainConfig()) == [
        f"config: every option in {TrainConfig().run.run_dir}/config.json; all at their defaults"
    ]


# The metrics plot


class Lines(logging.Handler):
    """The messages logged to `trainers` (whose handlers do not propagate to caplog's)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def trainer_log() -> Lines:
    handler = Lines()
    logger = logging.getLogger("trainers")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def plot_run(tmp_path: Path) -> tuple[Path, str, float]:
    """What `draw_plot` takes: a run's metrics file, its directory and the threshold."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {
            "kind": "train",
            "step": s,
            "epoch": 0,
            "loss": 1.0 / s,
            "lr": 0.1,
            "images_per_s": 100.0,
            "data_wait_frac": 0.1,
        }
        for s in (1, 2)
    ]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return metrics, str(tmp_path), 0.2


def test_plot_is_skipped_as_not_installed_only_when_matplotlib_is_missing(
    tmp_path, monkeypatch, trainer_log
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what find_spec reports as absent
    draw_plot(*plot_run(tmp_path))
    assert trainer_log.messages == [
        "plot skipped: matplotlib is not installed; `pip install matplotlib` draws it"
    ]
    assert not (tmp_path / PLOT_NAME).exists()


def test_a_broken_matplotlib_says_so_and_the_run_still_ends(tmp_path, monkeypatch, trainer_log):
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ImportError('libfreetype.so.6: cannot open shared object file')\n"
    )
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(fake.parent))
    draw_plot(*plot_run(tmp_path))
    (message,) = trainer_log.messages
    assert "matplotlib is installed but does not import (libfreetype.so.6" in message
    assert "pip install --force-reinstall matplotlib" in message
    assert "not installed" not in message


def test_plot_is_drawn_with_matplotlib(tmp_path, trainer_log):
    pytest.importorskip("matplotlib")
    draw_plot(*plot_run(tmp_path))
    png = tmp_path / PLOT_NAME
    assert trainer_log.messages == [f"plot: {png}"]
    assert png.read_bytes().startswith(b"\x89PNG")


def test_log_lines_of_a_second_main_go_to_the_stderr_of_then(monkeypatch):
    """`train` run twice in one process (tests, a notebook), each time under another
    `sys.stderr`: the loader's lines go to the current one, not to a closed first one
    ('--- Logging error ---', which broke inspect-shuffle's one-line error after a train)."""
    from trainers.distributed import DistInfo, setup_logging

    first, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logger = logging.getLogger("pipeline")
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))  # restored after
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    setup_logging(DistInfo(0, 1, 0, torch.device("cpu")))
    first.close()  # what pytest's capture does at the end of a test
    monkeypatch.setattr(sys, "stderr", now)
    logger.warning("a line after the first stderr closed")
    assert "a line after the first stderr closed" in now.getvalue()
    assert "Logging error" not in now.getvalue()
