"""A crash is pinned to the node whose rank died of a fault signal whatever torchrun names first
(launch.attempts.fault_pids): from the text torchrun printed in a CI failure, and from a real torchrun
made to print the same layout on every run (tests/launch/peer_observed_first.py). The other node of the
job, whose ranks only failed in their collectives or were stopped by their own torchrun, is not pinned."""

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

# The same crash as the other node's torchrun printed it: its rank 2 failed in the collective (exit 1), and
# its rank 3, stopped by that torchrun, died of the SIGTERM it sent. No fault of that node's own.
PEER = """\
W1203 21:40:02.498000 22107 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22151 closing signal SIGTERM
E1203 21:40:02.701000 22107 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 22150) of binary: /venv/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_21:40:02
  host      : vm2
  rank      : 3 (local_rank: 1)
  exitcode  : -15 (pid: 22151)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22151
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_21:40:01
  host      : vm2
  rank      : 2 (local_rank: 0)
  exitcode  : 1 (pid: 22150)
  error_file: /tmp/torchelastic_y/attempt_0/0/error.json
  traceback : RuntimeError: Connection reset by peer
============================================================
"""


def node_log(run: Path, task: int, text: str) -> None:
    """srun task ``task``'s log (one task a node, emulated nodes on one host: the node list names it)."""
    logs = run / "launcher" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"node{task}-vm.log").write_text(text)


def test_a_sigkill_listed_only_in_the_failure_table_is_a_fault():
    assert attempts.fault_pids(RECORDED) == {18370}


def test_only_the_node_whose_rank_was_killed_is_pinned(tmp_path):
    """Two nodes' logs of one crash: the SIGKILLed rank's node is pinned, the peer node stays in the job."""
    assert attempts.fault_pids(PEER) == set()
    node_log(tmp_path, 0, RECORDED)
    node_log(tmp_path, 1, PEER)
    assert attempts.fault_nodes(tmp_path, {}, ["lfnode2", "lfnode3"]) == {"lfnode2"}
    node_log(tmp_path, 0, PEER)
    node_log(tmp_path, 1, RECORDED)  # the order of the node list, not of the logs, names the node
    assert attempts.fault_nodes(tmp_path, {}, ["lfnode2", "lfnode3"]) == {"lfnode3"}


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
    run (the script orders the events; see its docstring); the node of the SIGKILLed rank is still pinned,
    and a second node whose torchrun logged only its peers' failures (PEER) is not."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(Path(__file__).with_name("peer_observed_first.py")), str(tmp_path / "recorded")],
                         capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    node_log(tmp_path, 0, log)
    node_log(tmp_path, 1, PEER)
    first = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", log)
    assert out.returncode != 0 and first and first.groups() == ("-15", "0"), log  # the harder order, made
    assert re.search(r"exitcode\s*: -9 \(pid: \d+\)", log), log
    assert attempts.fault_nodes(tmp_path, {}, ["lfnode2", "lfnode3"]) == {"lfnode2"}
