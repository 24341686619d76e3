"""Two ranks agree on a damaged latest checkpoint: rank 0 moves it aside, both resume from the
previous one, and the replayed steps give the losses of the first time.

The first time is the session's 2-rank reference run (tests/conftest.py's ``reference``, made once for
the launcher tests anyway): a copy of its run dir has its last checkpoint torn, so only the resume
is launched here."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import rundir
from tests.conftest import SHORT, STEPS, reference_run, train


@pytest.mark.slow
def test_two_ranks_move_a_damaged_checkpoint_aside_and_replay_exactly(reference, tmp_path_factory, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory), run)
    previous, last = rundir.complete_steps(run)[-2:]  # the recipe keeps two: 16 and 20
    assert last == STEPS
    logged = (run / "metrics.jsonl").read_text().splitlines()
    for f in rundir.step_dir(run, last).glob("*.distcp"):  # every rank's shard file
        os.truncate(f, f.stat().st_size // 2)

    result = train("tiny.toml", f"run.output_dir={run}", *SHORT, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert out.count(f"DAMAGED CHECKPOINT {rundir.step_dir(run, last)}") == 1  # one loud line, from rank 0
    assert (rundir.checkpoints_dir(run) / f"step-{last}.damaged").is_dir()
    assert f"Training starts at step {previous + 1}" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[len(logged):]]
    again = {r["step"]: r["loss_metrics/global_avg_loss"] for r in rows if "loss_metrics/global_avg_loss" in r}
    assert again == {s: reference[s] for s in range(previous + 1, last + 1)}  # the replay's own rows, exact
    assert rundir.complete_steps(run) == [previous, last]
