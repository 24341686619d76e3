"""The README's commands of the group "plan" (the planner on the 2B: phase 1's plot, long.toml at four lengths), run
as documented, in README order: tests/test_readme_commands.py says how each runs and what it must print and
write."""

import pytest

from tests.test_readme_commands import run_group


@pytest.mark.slow
def test_the_readme_s_plan_commands_run_as_documented(work):
    run_group("plan", work)
