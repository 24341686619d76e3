"""One guard for the combinations a recipe allows: every feature a preference recipe can combine with a
loss type has a row here, and its test runs once for each loss type (``train.preference.loss.LOSSES``).
A new loss type, or a row's test that stops covering one, fails this test, naming the gap.

The rows' tests live beside the feature they check; this table only names them, so that the whole
matrix is read in one place."""

from __future__ import annotations

import subprocess
import sys

from rundir import REPO
from train.preference.loss import LOSSES

ROWS = {
    "held-out evaluation (eval/pref_loss, eval/pref_accuracy)":
        "tests/e2e/test_preference.py::test_every_loss_type_evaluates_held_out_pairs_and_resumes_on_another_world_size",
    "resume on another world size (2 or 4 ranks onto 1)":
        "tests/e2e/test_preference.py::test_every_loss_type_evaluates_held_out_pairs_and_resumes_on_another_world_size",
    "sweep report (compared on held-out accuracy, never across loss scales)":
        "tests/train/test_sweep_report.py::test_sweep_report_compares_each_loss_type_on_held_out_accuracy",
    "decontaminated pairs (prompt and both answers)":
        "tests/data/test_decontaminate.py::test_decontaminated_pairs_are_one_tokenization_whatever_the_loss_type",
    "pair-source weights (equal, or refused at load)":
        "tests/train/test_preference.py::test_pair_sources_take_equal_weights_and_no_token_budget_whatever_the_loss",
}


def test_every_feature_is_tested_with_every_loss_type():
    tests = sorted(set(ROWS.values()))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    collected = set(out.stdout.split())
    missing = [f"{feature}: {test}[{loss}]" for feature, test in ROWS.items() for loss in LOSSES
               if f"{test}[{loss}]" not in collected]
    assert not missing, "not tested:\n" + "\n".join(missing) + f"\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
