"""One guard for the combinations a recipe allows: every feature a preference recipe can combine with a
loss type has a row here, marked by whether the loss type plays a part in it. A row the loss type changes
(what is trained, evaluated, resumed or compared) runs its test once for each loss type
(``train.preference.loss.LOSSES``); a row it does not (the loss is read by training alone, after the row's
work is done) runs its test once, which shows that it is the same whatever the loss. A new loss type, a row's
test that stops covering one, or a loss-independent row's test parametrized by loss fails this test,
naming the gap.

The rows' tests live beside the feature they check; this table only names them, so that the whole
matrix is read in one place."""

from __future__ import annotations

import subprocess
import sys

from rundir import REPO
from train.preference.loss import LOSSES

PER_LOSS, ONCE = "per loss", "once"  # the loss type plays a part in the row, or none
E2E = "tests/e2e/test_preference.py::test_every_loss_type_evaluates_held_out_pairs_and_resumes_on_another_world_size"
ROWS = {  # feature -> (its test, PER_LOSS or ONCE)
    "held-out evaluation (eval/pref_loss, eval/pref_accuracy)": (E2E, PER_LOSS),
    "resume on another world size (2 or 4 ranks onto 1)": (E2E, PER_LOSS),
    "sweep report (compared on held-out accuracy, never across loss scales)": (
        "tests/train/test_sweep_report.py::test_sweep_report_compares_each_loss_type_on_held_out_accuracy", PER_LOSS),
    "decontaminated pairs (prompt and both answers)": (
        "tests/data/test_decontaminate.py::test_decontaminated_pairs_are_one_tokenization_whatever_the_loss_type",
        ONCE),
    "pair-source weights (equal, or refused at load)": (
        "tests/train/test_preference.py::test_pair_sources_take_equal_weights_and_no_token_budget_whatever_the_loss",
        ONCE),
}


def test_every_feature_is_tested_with_every_loss_type_it_depends_on():
    tests = sorted({test for test, _ in ROWS.values()})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    collected = out.stdout.split()
    wrong = []
    for feature, (test, depends) in ROWS.items():
        found = sorted(c for c in collected if c == test or c.startswith(f"{test}["))
        expected = sorted(f"{test}[{loss}]" for loss in LOSSES) if depends == PER_LOSS else [test]
        if found != expected:
            wrong.append(f"{feature} ({depends}): collected {found or 'nothing'}, expected {expected}")
    assert not wrong, "\n".join(wrong) + f"\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
