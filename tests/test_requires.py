"""tests/requires.py: a missing dependency skips a test, and fails it under CI=true naming what is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rundir import REPO
from tests.requires import require

MISSING = "laneformer_no_such_module"


@pytest.mark.parametrize("program", [False, True], ids=["module", "program"])
def test_under_ci_a_missing_dependency_fails_naming_it(monkeypatch, program):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as e:
        require(MISSING, "the reason it is needed", program=program)
    assert MISSING in str(e.value) and "the reason it is needed" in str(e.value) and "CI=true" in str(e.value)


@pytest.mark.parametrize("ci", [None, "false", "1"])
def test_elsewhere_it_skips_naming_it(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception) as e:
        require(MISSING, "the reason it is needed")
    assert MISSING in str(e.value) and "the reason it is needed" in str(e.value)
    with pytest.raises(pytest.skip.Exception, match="the program laneformer_no_such_module or sh2 is not on PATH"):
        require(MISSING, "why", program=True, alternatives=("sh2",))


def test_what_is_there_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require("json", "why").dumps([]) == "[]"
    assert require(MISSING, "why", program=True, alternatives=("sh",)).endswith("/sh")


def test_at_a_module_s_top_it_fails_its_collection_under_ci_and_skips_it_elsewhere(tmp_path):
    """As the RULER and sandbox test modules call it: the module's tests do not pass as skipped in CI."""
    test = tmp_path / "test_needs.py"
    test.write_text(textwrap.dedent(f"""
        from tests.requires import require
        require({MISSING!r}, "its tests need it")
        def test_it():
            pass
    """))
    for ci, rc, says in (("true", 2, f"CI=true but the module {MISSING} cannot be imported"),  # a collection error
                         ("", 5, "1 skipped")):  # 5: no test ran
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"--rootdir={tmp_path}", str(test)], cwd=REPO, capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "CI": ci}, timeout=120)
        assert run.returncode == rc and says in run.stdout, run.stdout[-2000:]
