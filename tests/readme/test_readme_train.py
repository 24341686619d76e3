"""The README's commands of the group "train" (train.py's flags, torchtitan's entry point, the report, gpu_check,
SLURM's dry runs), run as documented, in README order: tests/test_readme_commands.py says how each runs and what
it must print and write."""

import pytest

from tests.test_readme_commands import run_group


@pytest.mark.slow
def test_the_readme_s_train_commands_run_as_documented(work):
    run_group("train", work)
