"""What the README's command groups share (tests/test_readme_commands.py): the run ``make train`` makes, once per
session, for every group that reads {run}; and each group's placeholders."""

from __future__ import annotations

import os

import pytest

from tests.test_readme_commands import COMMANDS, MAKE_TRAIN, Work, run_checked


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory) -> str:
    """The README's first command, make train, run and checked as documented (its 6-step run, its checkpoints,
    its last line) by the first group that reads its run, in the temp dir every pytest-xdist worker of the
    session shares, while a group on the other worker waits on its lock; its verdict is every group's."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "readme-run"
    with FileLock(f"{shared}.lock"):
        verdict = shared / "verdict.txt"
        if not verdict.is_file():
            shared.mkdir(exist_ok=True)
            problem = run_checked(COMMANDS[MAKE_TRAIN], {"tmp": str(shared), "run": str(shared / "main")})
            verdict.write_text(problem or "")
        problem = verdict.read_text()
    if problem:
        pytest.fail(f"{MAKE_TRAIN} (the run the group's commands read)\n  {problem}", pytrace=False)
    return str(shared / "main")


@pytest.fixture
def work(request, tmp_path) -> Work:
    """The group's placeholders in its own folder; {run} the session's, made when a command first reads it."""
    return Work(tmp_path, lambda: request.getfixturevalue("readme_run"))
