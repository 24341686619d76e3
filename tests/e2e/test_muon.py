"""Muon (``[optimizer] name = "muon"``, train.muon.LaneMuon) on real processes (torchrun, gloo FSDP2 on CPU):
from the same AdamW-trained weights, 1, 2 and 4 ranks train alike; a kill -9 of every rank and the resume
give the uninterrupted run's losses and final weights and momentum to the bit (one test: the 1-rank run is
the reference layout and the uninterrupted run).

The layouts test uses a 2-lane tiny model so that both of LaneMuon's ways run: on 2 ranks FSDP shards each lane
weight over its lanes (a rank holds one whole lane: Newton–Schulz on it, no communication); on 4 ranks, more
ranks than lanes, parallelize.lane_placement shards dim 1, and the step all-gathers the update first. The
lane-by-lane equality with torch.optim.Muon is tests/train/test_muon.py's."""

from __future__ import annotations

import subprocess

import pytest
import torch

import rundir
from models.laneformer import read_native_config
from models.laneformer.hf.checkpoint_io import load_dcp
from rundir import REPO
from tests.conftest import checkpoint_tensors, env, kill_tree, losses, train, train_command
from tests.e2e.test_train_runs import wait_for

pytestmark = pytest.mark.slow

SETS = ("training.seq_len=64", "training.global_batch=8", "training.micro_batch=1", "schedule.warmup_steps=2",
        "logging.interval=1", "run.deterministic=true", "logging.tensorboard=false", "eval.at_end=false")
MUON = ('optimizer.name="muon"',)


def run(run_dir, *sets, nproc):
    result = train("tiny.toml", f"run.output_dir={run_dir}", *SETS, *sets, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def weights(run_dir, step):
    return load_dcp(rundir.step_dir(run_dir, step), read_native_config(run_dir / rundir.MODEL_CONFIG_FILE))


def relative_rms(got: dict, reference: dict, initial: dict, names: list[str]) -> float:
    """RMS of ``got - reference`` over ``names``, relative to the RMS of what the reference run moved them."""
    off = sum(((got[n] - reference[n]).double() ** 2).sum() for n in names)
    moved = sum(((reference[n] - initial[n]).double() ** 2).sum() for n in names)
    return float((off / moved).sqrt())


def test_muon_trains_alike_on_one_two_and_four_ranks_and_resumes_after_kill_9_to_the_bit(tmp_path):
    """An AdamW run's step-1 weights (``init_from``, weights only: its AdamW moments are not loaded into Muon)
    trained by Muon on 1, 2 and 4 ranks: after 3 steps, the same losses, and the same weights to the rounding of
    summing the gradients in another order. Muon amplifies that rounding (Newton–Schulz runs in bf16 and its
    quintic has slope 3.4 at zero, so a gradient's last bits move small singular directions a lot): its size is
    measured here, as one rank's run with 2 sequences per micro batch instead of 1 (the same layout, another
    summation order), and 2 and 4 ranks may differ from 1 rank by no more than twice that (measured: ~0.9% of
    the update's RMS, for the control and the layouts alike). A lane orthogonalised with a piece of another, or a
    shard orthogonalised alone, moves the weights by a large part of the update.

    Then kill -9 of torchrun and its rank after the step-3 checkpoint of the same 1-rank run: the resumed run's
    losses, weights, Muon momentum and AdamW moments at step 6 equal the uninterrupted 1-rank run's, bit for bit
    (one rank: the resume is the optimizer's state, which the layouts above already showed the same).
    (No decay in the schedule: the 3- and 6-step runs share their first 3 learning rates.)"""
    lanes = ("model.n_lanes=2", "schedule.decay_fraction=0")
    start = tmp_path / "adamw"
    run(start, *lanes, "training.steps=1", "schedule.warmup_steps=0", nproc=1)
    muon = (*lanes, *MUON, "training.steps=3", f"checkpoint.init_from={start}", "checkpoint.keep_last=10")
    six = ("training.steps=6", "checkpoint.interval=3")
    out = {}
    for name, nproc, sets in (("1", 1, six), ("control", 1, ("training.micro_batch=2",)), ("2", 2, ()), ("4", 4, ())):
        out[name] = run(tmp_path / name, *muon, *sets, nproc=nproc)
        assert "Optimizer LaneMuon" in out[name] and "Training starts at step 1" in out[name]
    assert "dp_shard=4" in out["4"]
    reference, final, initial = losses(tmp_path / "1"), weights(tmp_path / "1", 3), weights(start, 1)
    on_muon = [n for n in final if ".attention.w" in n or ".feed_forward.w" in n]
    on_adamw = [n for n in final if n not in on_muon]
    assert len(on_muon) == 28 and all(not torch.equal(final[n], initial[n]) for n in on_muon)
    floor = relative_rms(weights(tmp_path / "control", 3), final, initial, on_muon)
    assert 0 < floor < 0.05
    for nproc in ("2", "4"):
        got, trained = losses(tmp_path / nproc), weights(tmp_path / nproc, 3)
        assert all(got[s] == pytest.approx(reference[s], rel=1e-5) for s in (1, 2, 3)), (nproc, got, reference)
        assert relative_rms(trained, final, initial, on_muon) <= 2 * floor, nproc
        assert relative_rms(trained, final, initial, on_adamw) < 1e-3, nproc

    killed = tmp_path / "killed"
    sets = ("tiny.toml", f"run.output_dir={killed}", *SETS, *muon, *six, "logging.report=false")
    proc = subprocess.Popen(train_command(*sets, nproc=1), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(rundir.step_dir(killed, 3) / ".metadata", proc)
    kill_tree(proc.pid)  # torchrun and every rank at once
    proc.wait()
    assert max(losses(killed)) < 6
    resumed = run(killed, *muon, *six, nproc=1)
    assert "Training starts at step 4" in resumed
    assert losses(killed) == losses(tmp_path / "1")
    a, b = checkpoint_tensors(rundir.step_dir(killed, 6)), checkpoint_tensors(rundir.step_dir(tmp_path / "1", 6))
    assert a.keys() == b.keys() and any("momentum_buffer" in k for k in a) and any("exp_avg" in k for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
