"""The README's commands of the group "export" (Hugging Face export and import, CORE, EvalPlus, generation on one
and two processes), run as documented, in README order: tests/test_readme_commands.py says how each runs and what
it must print and write."""

import pytest

from tests.test_readme_commands import run_group


@pytest.mark.slow
def test_the_readme_s_export_commands_run_as_documented(work):
    run_group("export", work)
