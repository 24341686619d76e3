"""Name the straggler: each rank's own compute speed and data wait, compared at every logging step.

In synchronous training every rank's step time is the slowest rank's: the
collectives make the others wait, so step times cannot say which rank is slow.
Two per-rank numbers can:

- **compute**: a fixed GEMM health check, timed on the rank alone with no
  collective (as NVIDIA's straggler detection scores GPUs with reference
  kernels). Not the training step's own compute: FSDP's all-gathers and
  reduce-scatters run inside forward and backward (on CPU/gloo they block the
  compute thread; on CUDA they overlap on other streams and events around the
  compute would still include waiting for them), so only a kernel that waits on
  nobody measures the rank and not its peers. It runs at logging steps only
  (CUDA: synchronized around it there, where the logging step already reads
  the loss), on tensors made once, without touching any random state;
- **data wait**: the seconds this rank waited for batches since the last
  logging step (``LaneformerTrainer.batch_generator``).

At each logging step the ranks all-gather the two numbers over a gloo group
(one small host collective, on the logging step only: ``train.callbacks.straggler``);
rank 0 logs ``straggler/*`` (min, median, max, the slowest rank and its host) and
flags a rank whose compute time exceeds the median of the *other* ranks by more than
``[launch] straggler_threshold`` for ``straggler_windows`` logging steps in a row: a line
on stderr, an entry in ``<run>/alerts.jsonl`` (``launch.slurm status`` lists
the hosts) and ``wandb.alert`` when wandb is online. The streaks are the same on
every rank and are checkpointed, so a restart continues them.

The reference is a leave-one-out median, the upper one for an even count of others
(``statistics.median_high``): a rank is named when it is slower by the threshold than more than
half of the other ranks. Not the median over all ranks: that includes the rank judged, so with 2
ranks it is their mean and a rank must be (1 + t) / (1 - t) times slower to exceed it (never, for
t >= 1). Not a robust spread (median absolute deviation): with a handful of ranks it is 0 or the
noise of one rank, and it would turn a threshold people can read (20% slower) into a count of
deviations. The upper median, not the mean of the two middle others: with 3 ranks a rank much
faster than the other two would otherwise pull their reference down and name a normal rank.
"""

from __future__ import annotations

import statistics
import time

import torch

# The check's size: ~50 ms on one CPU core, a few ms on an H100. On a CPU it must outlast the scheduler's
# credit to a task that slept (CFS runs a rank waking from a collective ahead of a busy neighbour for a few
# ms): only then does a shared core show, in chunks of ~10 ms.
GEMM = {"cpu": (256, 250), "cuda": (4096, 50)}  # device type: (n of n x n, repetitions)
CHUNKS = 5


def gemm_seconds(a: torch.Tensor, b: torch.Tensor, reps: int, chunks: int = CHUNKS) -> float:
    """Wall seconds of ``reps`` GEMMs on this rank alone: ``chunks`` times the median chunk, so a
    passing hiccup does not count and a core shared all along does."""
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    times = []
    for _ in range(chunks):
        sync()
        start = time.perf_counter()
        for _ in range(reps // chunks):
            torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - start)
    return chunks * statistics.median(times)


def others_median(compute: list[float], rank: int) -> float:
    """The reference ``rank`` is judged against: the upper median of the other ranks' compute times."""
    return statistics.median_high(compute[:rank] + compute[rank + 1:])


class Streaks:
    """Logging steps in a row that each rank's compute check exceeded the others' median by ``threshold``."""

    def __init__(self, threshold: float, windows: int):
        self.threshold, self.windows = threshold, windows
        self.streak: dict[int, int] = {}

    def judge(self, compute: list[float]) -> list[int]:
        """Count one logging step's compute times (one per rank, at least 2); returns the ranks whose
        streak reaches ``windows`` now (named once per streak)."""
        named = []
        for rank, seconds in enumerate(compute):
            slow = seconds > others_median(compute, rank) * (1 + self.threshold)
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if self.streak[rank] == self.windows:
                named.append(rank)
        return named

    def state_dict(self) -> dict:
        return {"streak": {str(r): n for r, n in self.streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.streak = {int(r): n for r, n in state.get("streak", {}).items()}
