"""The README's commands of the group "long" (tiny-long from the run and its evals: loss by position, passkey,
RULER), run as documented, in README order: tests/test_readme_commands.py says how each runs and what it must
print and write."""

import pytest

from tests.test_readme_commands import run_group


@pytest.mark.slow
def test_the_readme_s_long_commands_run_as_documented(work):
    run_group("long", work)
