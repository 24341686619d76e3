"""A crash is pinned to the node whose rank died of a fault signal whatever torchrun names first
(launch.attempts.fault_pids): from the text torchrun printed in a CI failure, and from a real torchrun
made to print the same layout on every run (tests/launch/peer_observed_first.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import attempts

# A clean clone's CI run (issue 43): rank 1 SIGKILLed, rank 0 failed in the straggler check's all_gather
# and is the root cause torchrun names first; the SIGKILL is only in the table.
RECORDED = """\
W1203 21:40:02.512000 18301 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 18368 closing signal SIGTERM
E1203 21:40:02.730000 18301 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -15) local_rank: 0 (pid: 18368) of binary: /venv/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[0]:
  time      : 2026-12-03_21:40:02
  host      : vm
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 18370)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 18370
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-12-03_21:40:01
  host      : vm
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 18368)  (SIGTERM)
  error_file: /tmp/torchelastic_x/attempt_0/0/error.json
  traceback : RuntimeError: Connection reset by peer
============================================================
"""


def test_a_sigkill_listed_only_in_the_failure_table_is_a_fault():
    assert attempts.fault_pids(RECORDED) == {18370}


def test_a_rank_torchrun_killed_itself_is_not_a_fault():
    """A rank that ignores the closing SIGTERM past torchrun's timeout is SIGKILLed by torchrun: -9 in
    the table, but the node did nothing."""
    hung = RECORDED.replace("rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 18370)  (SIGKILL)",
                            "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 18371)  (SIGKILL)")
    hung = hung.replace("Sending process 18368 closing signal SIGTERM",
                        "Sending process 18368 closing signal SIGTERM\nW1203 21:40:32.512000 18301 torch/distributed/"
                        "elastic/multiprocessing/api.py:1043] Unable to shutdown process 18371 via Signals.SIGTERM, "
                        "forcefully exiting via Signals.SIGKILL")
    assert attempts.fault_pids(hung) == set()


@pytest.mark.slow
def test_a_peer_observed_first_does_not_hide_the_killed_rank(tmp_path):
    """Real torchrun, 2 gloo ranks: the peer's failed collective is the first failure it prints, on every
    run (the script orders the events; see its docstring); the node of the SIGKILLed rank is still pinned."""
    logs = tmp_path / "launcher" / "logs"
    logs.mkdir(parents=True)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(Path(__file__).with_name("peer_observed_first.py")), str(tmp_path / "recorded")],
                         capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    (logs / "node0-vm.log").write_text(log)
    first = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", log)
    assert out.returncode != 0 and first and first.groups() == ("-15", "0"), log  # the harder order, made
    assert re.search(r"exitcode\s*: -9 \(pid: \d+\)", log), log
    assert attempts.fault_nodes(tmp_path, {}, ["lfnode2"]) == {"lfnode2"}
