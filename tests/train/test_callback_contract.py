"""The callbacks' contract (``train.callbacks.callback.TrainerView``) holds by the type check: a callback
reading what its view does not name, or writing to the trainer, fails mypy as ``make test`` runs it. One
view for every kind of run: what an objective adds is reached through ``trainer.objective``'s own methods
(train.objectives.base.Objective), never by reading a particular objective's attributes."""

from __future__ import annotations

import subprocess
import sys

from rundir import REPO

SNIPPET = """
from train.callbacks.callback import Callback, TrainerView


class Pretraining(Callback[TrainerView]):
    def post_step(self, trainer: TrainerView) -> None:
        print(trainer.step, trainer.config.dump_folder)  # named by the view
        print(trainer.held_out_pairs)  # a preference objective's, not the trainer's
        trainer.step = 0  # read-only


class AnyObjective(Callback[TrainerView]):
    def post_step(self, trainer: TrainerView) -> None:
        if trainer.objective.evaluates:  # the objective's own evaluation, whichever it is
            print(trainer.objective.evaluate(trainer))
        print(trainer.objective.held_out_pairs)  # one objective's attribute: not the contract
"""


def test_a_callback_reading_outside_its_view_fails_the_type_check(tmp_path):
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    # the project's settings and cache (.mypy_cache, warm after make test's own run)
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", str(snippet)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line.split(": error: ", 1)[1] for line in result.stdout.splitlines() if ": error: " in line]
    assert errors == ['"TrainerView" has no attribute "held_out_pairs"  [attr-defined]',
                      'Property "step" defined in "TrainerView" is read-only  [misc]',
                      '"ObjectiveView" has no attribute "held_out_pairs"  [attr-defined]'], result.stdout + result.stderr
    assert result.returncode == 1
