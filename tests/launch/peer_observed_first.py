"""Two gloo ranks that make torchrun report a SIGKILLed rank only in its failure table, with the peer
whose collective failed named first (tests/launch/test_failure_table.py runs it under torchrun).

Rank 1 stays out of a collective; rank 0's times out, its failure is recorded in its torchelastic error
file (as ``@record`` does) and it stays up, as a rank busy shutting down does. Only then, and in the
next wall-clock second, rank 1 is SIGKILLed, as the OOM killer would. torchrun's failure timestamps are
whole seconds and an error file's is the time it was written, so rank 0's failure is strictly the
earliest: torchrun's "failed (exitcode: ...)" line names rank 0 (SIGTERMed when torchrun closes the
group), and rank 1's SIGKILL appears only in the table. The order is made, not won by chance.
"""

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler


def main(recorded: Path) -> None:
    dist.init_process_group("gloo")  # the default timeout: a slow start on a loaded machine is no failure
    quick = dist.new_group(timeout=datetime.timedelta(seconds=2))  # both ranks join it; only rank 0 uses it
    if dist.get_rank() == 1:
        while not recorded.exists():
            time.sleep(0.05)
        while int(time.time()) <= int(recorded.read_text()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.zeros(1), group=quick)  # rank 1 never joins: gloo's timeout
    except RuntimeError as e:
        get_error_handler().record_exception(e)
        written = recorded.with_suffix(".part")
        written.write_text(str(int(time.time())))
        written.replace(recorded)  # whole or absent: rank 1 polls for it and would read a half-written file
    time.sleep(600)  # until torchrun closes the group


if __name__ == "__main__":
    main(Path(sys.argv[1]))
