"""The docs run as pasted: every shell and Python block of README.md and docs/MIGRATION.md.

Each doc runs in a fresh folder, in order, as a user would paste it: one bash session
for its shell blocks, one Python session (the venv's python, started in that folder) for
its Python blocks, so a block may use what an earlier one made. The folder gets a `.venv`
symlink to the repository's venv and a `docs` symlink to its docs (the examples' commands
name `docs/examples/...`); `bash .ci/setup` is replaced by a no-op, since the venv exists.
The command in each docs/examples/*.py docstring (its indented lines) runs in the README's
session after the README's blocks, on the data those made.

A block that needs what CI lacks is marked in the doc, on the line before its fence, with
`<!-- docs-test: skip (the reason) -->`; the reason is required.

Also here: our packages import from a working directory holding folders named like them
(`shards/`, `pipeline/`, ...), as MIGRATION.md's own build makes one.
"""

from __future__ import annotations

import ast
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS_RUN = ("README.md", "docs/MIGRATION.md")
PACKAGE_NAMES = ("shards", "pipeline", "preprocess", "trainers")
LANGUAGES = {"bash": "shell", "sh": "shell", "python": "python"}
SETUP_COMMAND = "bash .ci/setup"
SETUP_NO_OP = "true"  # the venv this test runs in is what .ci/setup makes
BLOCK_TIMEOUT_S = 300
DONE = "__DOCS_TEST_DONE__"
_FENCE = re.compile(r"^```(\S*)(.*)$")
_SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One runnable block of a doc: where it starts, its language, its code."""

    source: str  # "README.md:12"
    language: str  # "shell" or "python"
    code: str
    skip_reason: str | None = None


# The guides run in the folder of the README's quick start, which their blocks name
# (`data/shards`): the prelude makes its data first (fewer images, the same shape).
GUIDES = ("docs/LOADER.md", "docs/TRAINING.md", "docs/SHARDS.md")
GUIDE_PRELUDE = Block(
    "quick start (prelude)",
    "shell",
    ".venv/bin/preprocess make-sample --output data/sample --count 200 --overwrite\n"
    ".venv/bin/preprocess build-shards --input data/sample --output data/shards "
    "--val-fraction 0.1 --no-progress\n",
)


def doc_blocks(text: str, name: str) -> list[Block]:
    """The bash/sh/python fenced blocks of a markdown text, in order, with their skip marks."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        start, body = index, []
        index += 1
        while index < len(lines) and not lines[index].startswith("```"):
            body.append(lines[index])
            index += 1
        index += 1
        language = LANGUAGES.get(match.group(1))
        if language is None:
            continue
        blocks.append(
            Block(f"{name}:{start + 1}", language, "\n".join(body) + "\n", skip_mark(lines, start))
        )
    return blocks


def skip_mark(lines: list[str], fence: int) -> str | None:
    """The reason of a `docs-test: skip` comment on the last non-blank line before a fence."""
    before = fence - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    match = _SKIP.match(lines[before].strip()) if before >= 0 else None
    return match.group(1).strip() if match else None


def example_commands(path: Path) -> list[Block]:
    """The command of an example's docstring: its lines indented by four spaces, as one block."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    name = path.relative_to(REPO).as_posix()
    runs, current = [], []
    for line in [*docstring.splitlines(), ""]:
        if line.startswith("    "):
            current.append(line[4:])
        elif current:
            runs.append(current)
            current = []
    return [Block(f"{name} (docstring)", "shell", "\n".join(run) + "\n") for run in runs]


def blocks_to_run(doc: str) -> list[Block]:
    """A doc's blocks in order; the README's session also runs the examples' commands,
    and a guide's starts with the quick start's data (`GUIDE_PRELUDE`)."""
    blocks = doc_blocks((REPO / doc).read_text(), doc)
    if doc in GUIDES:
        blocks = [GUIDE_PRELUDE, *blocks]
    if doc == "README.md":
        for example in sorted((REPO / "docs" / "examples").glob("*.py")):
            blocks += example_commands(example)
    return blocks


# --- the two sessions -------------------------------------------------------------------------

# The Python session: execs each block file it is sent in one namespace, in the folder it
# was started in (sys.path[0] is that folder, as for `python` typed there), and answers
# on its own stdout. Each block's output, its worker processes' included, goes to its log.
# Blocks run in `__main__`'s own namespace, as a pasted script's do, so what they define
# pickles by name (`functools.partial(add_noise)` for spawned workers); the driver keeps
# its own names inside a function.
PYTHON_DRIVER = f"""
def _drive():
    import os, sys, traceback, __main__
    answer = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        block, log = line.rstrip("\\n").split("\\t")
        sys.stdout.flush(); sys.stderr.flush()
        with open(log, "w") as out:
            os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
        status = 0
        try:
            with open(block) as code:
                exec(compile(code.read(), block, "exec"), __main__.__dict__)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        print("{DONE}", status, 0, file=answer, flush=True)
_drive()
"""

# The shell session runs each block with `source`, so `cd` and variables carry on; a block
# fails when its last command fails or when any command in it fails (the ERR trap), as
# `set -e` would see it, without ending the session.
SHELL_STEP = (
    "__failed=0; trap '__failed=1' ERR; source {block} < /dev/null > {log} 2>&1; "
    '__status=$?; trap - ERR; echo "' + DONE + ' $__status $__failed"\n'
)


class Session:
    """One bash or Python process in the doc's folder, fed one block at a time."""

    def __init__(self, language: str, folder: Path, env: dict[str, str]) -> None:
        self.language = language
        self.folder = folder
        python = str(folder / ".venv" / "bin" / "python")
        command = ["bash", "--noprofile", "--norc"]
        if language == "python":
            command = [python, "-u", "-c", PYTHON_DRIVER]
        self.process = subprocess.Popen(
            command, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, code: str, number: int) -> tuple[bool, str]:
        """Runs one block; (passed, the tail of its output)."""
        suffix = "py" if self.language == "python" else "sh"
        block = self.folder / ".docs-test" / f"block-{number:02d}.{suffix}"
        log = block.with_suffix(".log")
        block.write_text(code)
        if self.language == "python":
            self.process.stdin.write(f"{block}\t{log}\n")
        else:
            self.process.stdin.write(SHELL_STEP.format(block=block, log=log))
        self.process.stdin.flush()
        answer = self.read_answer()
        output = log.read_text(errors="replace") if log.exists() else ""
        if answer is None:
            return False, output[-3000:] + f"\n(no answer within {BLOCK_TIMEOUT_S} s)"
        status, failed = answer.split()[1:3]
        return status == "0" and failed == "0", output[-3000:]

    def read_answer(self) -> str | None:
        """The session's answer line, or None when it died or took too long."""
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if ready:
                line = self.process.stdout.readline()
                if not line:
                    return None
                if line.startswith(DONE):
                    return line
            elif self.process.poll() is not None:
                return None
        return None

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def user_folder(root: Path) -> Path:
    """A fresh folder as a user's checkout looks to the docs: the venv and the docs in it."""
    root.mkdir(parents=True)
    (root / ".venv").symlink_to(REPO / ".venv")
    (root / "docs").symlink_to(REPO / "docs")
    (root / ".docs-test").mkdir()
    return root


def session_env(folder: Path) -> dict[str, str]:
    """The user's environment, with caches kept in the folder and no network tried."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHON"))}
    venv_bin = str(REPO / ".venv" / "bin")  # not activated: the docs say `.venv/bin/...`
    path = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry != venv_bin]
    env.pop("VIRTUAL_ENV", None)
    env.update(
        PATH=os.pathsep.join(path),
        HF_HOME=str(folder / ".docs-test" / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        MPLCONFIGDIR=str(folder / ".docs-test" / "matplotlib"),
        MPLBACKEND="Agg",
    )
    return env


def run_doc(doc: str, folder: Path) -> tuple[list[str], list[str], list[str]]:
    """Runs a doc's blocks in order; (passed, failed with output, skipped with reason)."""
    env = session_env(folder)
    sessions: dict[str, Session] = {}
    passed, failed, skipped = [], [], []
    try:
        for number, block in enumerate(blocks_to_run(doc)):
            if block.skip_reason:
                skipped.append(f"{block.source}: {block.skip_reason}")
                continue
            if block.language not in sessions:
                sessions[block.language] = Session(block.language, folder, env)
            code = block.code.replace(SETUP_COMMAND, SETUP_NO_OP)
            ok, output = sessions[block.language].run(code, number)
            if ok:
                passed.append(block.source)
            else:
                failed.append(f"--- {block.source} ({block.language}) failed:\n{output}")
    finally:
        for session in sessions.values():
            session.close()
    return passed, failed, skipped


# --- the tests --------------------------------------------------------------------------------


def test_doc_blocks_are_found_with_their_skip_marks():
    text = (
        "intro\n```bash\necho one\n```\n\n<!-- docs-test: skip (needs a GPU) -->\n\n"
        "```python ours\nprint(2)\n```\n```text\nnot run\n```\n```sh\necho three\n```\n"
    )
    blocks = doc_blocks(text, "X.md")
    assert [(b.source, b.language, b.skip_reason) for b in blocks] == [
        ("X.md:2", "shell", None),
        ("X.md:8", "python", "needs a GPU"),
        ("X.md:14", "shell", None),
    ]
    assert blocks[1].code == "print(2)\n"


def test_every_doc_and_example_has_blocks_to_run():
    for doc in DOCS_RUN:
        runnable = [block for block in blocks_to_run(doc) if not block.skip_reason]
        assert len(runnable) >= 3, doc
    for example in (REPO / "docs" / "examples").glob("*.py"):
        assert example_commands(example), f"{example} names no command in its docstring"


def test_a_failing_command_mid_block_fails_the_block(tmp_path):
    folder = user_folder(tmp_path / "session")
    session = Session("shell", folder, session_env(folder))
    try:
        assert session.run("cd docs\nfalse\necho still here\n", 0)[0] is False
        passed, output = session.run("pwd\n", 1)  # the `cd` carried over
        assert passed and output.strip().endswith("/docs")
    finally:
        session.close()


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("doc", DOCS_RUN)
def test_doc_runs_as_pasted(doc, tmp_path):
    folder = user_folder(tmp_path / "user")
    for name in PACKAGE_NAMES:  # as in the checkout the pages name: folders that hold files
        (folder / name).mkdir()
        (folder / name / "README.txt").write_text("not empty, as our package folders are\n")
    passed, failed, skipped = run_doc(doc, folder)
    summary = f"{doc}: {len(passed)} blocks passed, {len(failed)} failed, {len(skipped)} skipped"
    print(summary, *skipped, sep="\n")
    assert not failed, summary + "\n" + "\n".join(failed)
    assert len(skipped) <= 3, skipped


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("doc", GUIDES)
def test_guide_runs_as_pasted_or_marks_its_fragments(doc, tmp_path):
    """Every block of a guide runs from the quick start's folder, or is marked with why
    it cannot (a fragment, a GPU, a store we do not have): no block fails as pasted."""
    passed, failed, skipped = run_doc(doc, user_folder(tmp_path / "user"))
    summary = f"{doc}: {len(passed)} blocks passed, {len(failed)} failed, {len(skipped)} skipped"
    print(summary, *skipped, sep="\n")
    assert not failed, summary + "\n" + "\n".join(failed)
    assert len(passed) >= 3, summary  # the prelude and at least two of the guide's blocks


def test_imports_work_from_a_folder_holding_folders_named_like_our_packages(tmp_path):
    for name in PACKAGE_NAMES:
        (tmp_path / name).mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pipeline import LoaderConfig; from shards.formats import FORMATS; "
            "import preprocess.cli, trainers.train, pipeline; print(pipeline.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == REPO / "pipeline" / "__init__.py"
