"""A test's declared dependency that is not installed: a skip that says so here, a failure in CI.

``make setup`` installs every Python package the tests import (pyproject.toml's ``test`` extra, EvalPlus by
the Makefile) and ``.ci/run`` the programs (chromium), so under ``CI=true`` a missing one is a broken setup
whose tests would otherwise pass as skipped: it fails, naming what is missing, as a missing SLURM does
(tests/launch/test_launch_slurm.py); called at a test module's top, it is that module's collection error, which
stops the session before any test runs. Elsewhere (a partial install, a machine without chromium) it skips with
the same words."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def require(name: str, why: str, *, program: bool = False, alternatives: tuple[str, ...] = ()) -> ModuleType | str:
    """The module ``name`` imported (``program``: the path of the program ``name`` or of the first of
    ``alternatives`` on PATH); when it is missing, skip the test, or the whole module when called at its top,
    saying ``why`` it is needed, and fail instead under ``CI=true``."""
    __tracebackhide__ = True  # the skip's or failure's place: the caller's line
    if program:
        for candidate in (name, *alternatives):
            if found := shutil.which(candidate):
                return found
        what = f"the program {' or '.join((name, *alternatives))} is not on PATH"
    else:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            what = f"the module {name} cannot be imported ({e})"
    message = f"{what}: {why}"
    if in_ci():
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)
