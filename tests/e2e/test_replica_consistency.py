"""Replica consistency under HSDP (health/consistency.py), with a real bit flipped in one rank's shard.

6 gloo ranks as 2 shards x 3 replicas (replica groups [0, 2, 4] and [1, 3, 5]):
``LANEFORMER_TEST_BITFLIP=5:3`` flips one bit of rank 5's parameter shard, in the second group, after
step 3's optimizer update (a change the loss does not show); the check before
step 4's save catches it, names rank 5 and its host by majority vote, exits with its own code and
saves nothing. Resumed without the fault, the run goes on from the verified step-2 checkpoint (not
from a complete but unverified newer one planted beside it), passes the checks before its step-4 save
and ends as a clean run does (the exit note DONE, step 4 verified), its step 3 replayed to the bit (step 3's
loss was logged before the flip). A clean 6-rank run to compare the final tensors with would cost a third
launch of 6 ranks; exact resumes are the kill-and-resume tests' (tests/e2e/test_train_runs.py). With 2
replicas (no majority) both holders are named, here at a periodic check (``consistency_every=1``) right
after a bit of AdamW's first moment is flipped (``1:1:optimizer``): the parameters are still equal
then, so only the optimizer state's checksum can see it at that step.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest

from rundir import ALERTS_FILE, REPO, VERIFIED_FILE
from tests.conftest import env, losses, train_command
from health.exits import EXIT_FILE_ENV, Exit

pytestmark = pytest.mark.slow


def sets(run, *extra):
    return (f"run.output_dir={run}", "training.steps=4", "training.seq_len=64", "training.global_batch=12",
            "training.micro_batch=2", "schedule.warmup_steps=2", "logging.interval=1", "run.deterministic=true",
            "checkpoint.interval=2", "checkpoint.keep_last=10", "eval.at_end=false", *extra)


def launch(run, nproc, *extra, bitflip=None):
    """train.py on ``nproc`` ranks; returns (result, the exit note)."""
    note = run.parent / f"exit-{run.name}-{len(list(run.parent.glob('exit-*')))}.json"
    environment = {**env(), EXIT_FILE_ENV: str(note)}
    environment.pop("LANEFORMER_TEST_BITFLIP", None)
    if bitflip:
        environment["LANEFORMER_TEST_BITFLIP"] = bitflip
    result = subprocess.run(train_command("tiny.toml", *sets(run, *extra), nproc=nproc), cwd=REPO, env=environment,
                            capture_output=True, text=True, timeout=600)
    return result, (json.loads(note.read_text()) if note.exists() else {})


HSDP = ("parallel.shard=2", "parallel.replicate=3")


def test_a_flipped_bit_is_caught_before_the_save_and_the_run_resumes_from_the_verified_checkpoint(tmp_path):
    run = tmp_path / "run"
    result, note = launch(run, 6, *HSDP, bitflip="5:3")
    assert result.returncode != 0
    assert note["code"] == Exit.REPLICA_MISMATCH and note["reason"] == "replica mismatch"
    assert (note["step"], note["ranks"], note["hosts"], note["majority"]) == (4, [5], [socket.gethostname()], True)
    assert (note["shards"], note["differs_in"]) == ([1], ["parameters"])  # the second group's shard
    assert f"the odd one: rank 5 on {socket.gethostname()}" in note["message"]
    [alert] = [json.loads(line) for line in (run / ALERTS_FILE).read_text().splitlines()]
    assert (alert["kind"], alert["step"], alert["ranks"]) == ("replica_mismatch", 4, [5])
    checkpoints = run / "checkpoints"
    assert not (checkpoints / "step-4").exists()  # nothing saved after the flip
    assert (checkpoints / "step-2" / VERIFIED_FILE).is_file()

    # A complete checkpoint newer than the verified one, but never compared: not resumed from.
    shutil.copytree(checkpoints / "step-2", checkpoints / "step-3", ignore=shutil.ignore_patterns(VERIFIED_FILE))
    first = losses(run)  # step 3's loss came before the flip (after its update): the resume must replay it
    result, note = launch(run, 6, *HSDP)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Loading the checkpoint from {checkpoints / 'step-2'}" in result.stdout + result.stderr
    assert note["code"] == Exit.DONE and (checkpoints / "step-4" / VERIFIED_FILE).is_file()
    alerts = [json.loads(line) for line in (run / ALERTS_FILE).read_text().splitlines()]
    assert [a["step"] for a in alerts if a["kind"] == "replica_mismatch"] == [4]  # the flip's alone
    assert losses(run)[3] == first[3]  # replayed from the verified step 2, to the bit


def test_with_two_replicas_both_holders_of_a_flipped_optimizer_state_are_named_at_once(tmp_path):
    run, host = tmp_path / "run", socket.gethostname()
    result, note = launch(run, 2, "parallel.shard=1", "parallel.replicate=2", "training.global_batch=4",
                          "training.consistency_every=1", bitflip="1:1:optimizer")
    assert result.returncode != 0
    assert (note["code"], note["step"], note["ranks"], note["majority"]) == (Exit.REPLICA_MISMATCH, 1, [0, 1], False)
    assert note["differs_in"] == ["optimizer state"]  # the parameters are equal until step 2's update
    assert f"no majority among 2 replicas, the holders: rank 0 on {host}; rank 1 on {host}" in note["message"]
    assert not list(run.glob("checkpoints/step-*"))  # nothing saved
