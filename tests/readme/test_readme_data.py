"""The README's commands of the group "data" (data tokenized, checked and split; preference data; the dtp sweep's
dry run; the local launcher), run as documented, in README order: tests/test_readme_commands.py says how each
runs and what it must print and write."""

import pytest

from tests.test_readme_commands import run_group


@pytest.mark.slow
def test_the_readme_s_data_commands_run_as_documented(work):
    run_group("data", work)
