"""health/consistency.py's parts, in one process: the checksum sees any single flipped bit, the vote
names the odd replica (or, without a majority, every holder), the launcher restarts after a mismatch,
and the planner's cost line against a count by hand. The run itself (6 gloo ranks, a real bit
flipped) is tests/e2e/test_replica_consistency.py."""

from __future__ import annotations

import pytest
import torch

from launch.attempts import decide
from health.exits import Exit
from health.consistency import checksum, vote
from plan.replica import plan_lines


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_checksum_changes_with_any_single_flipped_bit(dtype):
    torch.manual_seed(0)
    tensors = [torch.randn(5, 7).to(dtype), torch.randn(3).to(dtype)]
    base = checksum(tensors)
    assert base.dtype == torch.int64 and torch.equal(checksum([t.clone() for t in tensors]), base)
    words = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    for bit in range(8 * dtype.itemsize):
        flipped = tensors[1].clone()
        flipped.view(words)[2] ^= torch.tensor(1 << bit, dtype=torch.int64).to(words)  # the sign bit too
        assert not torch.equal(checksum([tensors[0], flipped]), base), bit


def test_the_vote_names_the_odd_replica_or_every_holder_without_a_majority():
    a, b = (1, 2), (1, 3)
    assert vote([a, a, a]) == []
    assert vote([a, b, a]) == [1]
    assert vote([b, a, a, a]) == [0]
    assert vote([a, b]) == [0, 1]  # 2 replicas: no majority, both named
    assert vote([a, a, b, b]) == [0, 1, 2, 3]


def test_a_replica_mismatch_is_restarted_from_the_last_checkpoint():
    note = {"code": Exit.REPLICA_MISMATCH, "step": 4, "hosts": ["node7"]}
    action, cause, why = decide(1, note, before=0, after=2, recent_crashes=0, crashes_per_day=3)
    assert (action, cause) == ("restart", "replica mismatch")
    assert "after step 4 on node7" in why and "restarting from step 2" in why
    assert decide(1, note, before=2, after=2, recent_crashes=0, crashes_per_day=3)[0] == "fail"  # no progress


def test_the_planned_cost_per_step_at_192_gpus():
    """The 2B at 24 x 8 on H200s (4,800 GB/s): 12 bytes a parameter over 8 ranks read per check."""
    nparams, step_s = 2_320_069_632, 0.85
    read = 12 * nparams / 8  # 3.48 GB
    per_check = read / 4800e9  # 0.725 ms
    for every, interval in ((100, 2000), (100, 100), (300, 200)):
        [line] = plan_lines(nparams, 24, 8, every, interval, 4800.0, step_s)
        assert "(24 replicas of 8 shards): 3.48 GB read per rank, 0.73 ms per check" in line
        # counted by hand: the steps of 6,000 that check (a periodic check, a save, or both: once)
        checks = len({s for s in range(1, 6001) if s % every == 0 or s % interval == 0})
        per_step = per_check * checks / 6000
        assert f"{per_step * 1e3:.3f} ms per step ({per_step / step_s:.4%} of the step)" in line, line
    assert "cannot run: replicate = 1" in plan_lines(nparams, 1, 192, 100, 2000, 4800.0, step_s)[0]
