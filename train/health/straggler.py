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
(one small host collective, on the logging step only); rank 0 logs
``straggler/*`` (min, median, max, the slowest rank and its host) and flags a
rank whose compute time exceeds the median by more than ``[launch]
straggler_threshold`` for ``straggler_windows`` logging steps in a row: a line
on stderr, an entry in ``<run>/alerts.jsonl`` (``launch.slurm status`` lists
the hosts) and ``wandb.alert`` when wandb is online.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.health.heartbeat import ALERTS_FILE
from train.hooks import Hook

if TYPE_CHECKING:
    from train.trainer import LaneformerTrainer

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


class StragglerHook(Hook, Configurable):
    priority = 90  # with the step's metrics (after LogSourceTokens), before evals

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        threshold: float = 0.2  # [launch] straggler_threshold: slower than the median by this fraction
        windows: int = 5  # [launch] straggler_windows: logging steps in a row

    def __init__(self, config: Config):
        self.config = config
        self.group = None
        self.hosts: list[str] = []
        self.streak: dict[int, int] = {}
        self.data_seen = 0.0

    def _setup(self, trainer: LaneformerTrainer) -> None:
        kind = "cuda" if trainer.device.type == "cuda" else "cpu"
        n, self.reps = GEMM[kind]
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        self.a = torch.full((n, n), 1.0 / n, device=trainer.device, dtype=dtype)
        self.b = torch.eye(n, device=trainer.device, dtype=dtype)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            self.group = dist.new_group(backend="gloo")  # host tensors: no device sync to agree
            self.hosts = [""] * world
            dist.all_gather_object(self.hosts, socket.gethostname(), group=self.group)
        else:
            self.hosts = [socket.gethostname()]

    def after_step(self, trainer: LaneformerTrainer) -> None:
        if not trainer.metrics_processor.should_log(trainer.step) or not (
                dist.is_initialized() and dist.get_world_size() > 1):  # one rank: no one to wait for
            return
        if not self.hosts:
            self._setup(trainer)
        compute = gemm_seconds(self.a, self.b, self.reps)
        data = trainer.data_wait_s - self.data_seen
        self.data_seen = trainer.data_wait_s
        mine = torch.tensor([compute, data], dtype=torch.float64)
        if self.group is not None:
            everyone = [torch.zeros(2, dtype=torch.float64) for _ in self.hosts]
            dist.all_gather(everyone, mine, group=self.group)
        else:
            everyone = [mine]
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        self._judge(trainer, [t[0].item() for t in everyone], [t[1].item() for t in everyone])

    def _judge(self, trainer: LaneformerTrainer, compute: list[float], data: list[float]) -> None:
        median = statistics.median(compute)
        slowest = max(range(len(compute)), key=compute.__getitem__)
        # Numbers only (tensorboard takes scalars): a host is named in the key of its compute time.
        trainer.metrics_processor.logger.log({
            "straggler/compute_min_s": min(compute), "straggler/compute_median_s": median,
            "straggler/compute_max_s": compute[slowest], "straggler/slowest_rank": slowest,
            "straggler/data_wait_median_s": statistics.median(data), "straggler/data_wait_max_s": max(data),
            **{f"straggler/compute_s/{host}": max(c for c, h in zip(compute, self.hosts) if h == host)
               for host in set(self.hosts)}}, trainer.step)
        limit = median * (1 + self.config.threshold)
        for rank, seconds in enumerate(compute):
            self.streak[rank] = self.streak.get(rank, 0) + 1 if seconds > limit else 0
            if self.streak[rank] == self.config.windows:  # once per streak
                self._alert(trainer, rank, seconds, median)

    def _alert(self, trainer: LaneformerTrainer, rank: int, seconds: float, median: float) -> None:
        host, c = self.hosts[rank], self.config
        text = (f"rank {rank} on {host} is a straggler: its compute check took {seconds * 1e3:.1f} ms, "
                f"{seconds / median - 1:.0%} over the median {median * 1e3:.1f} ms, for {c.windows} logging steps "
                f"in a row (up to step {trainer.step}; [launch] straggler_threshold {c.threshold:g})")
        logger.warning(f"STRAGGLER: {text}")
        record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "kind": "straggler",
                  "step": trainer.step, "rank": rank, "host": host, "compute_s": seconds, "median_s": median,
                  "text": text}
        with open(Path(trainer.config.dump_folder) / ALERTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        try:
            import wandb

            if wandb.run is not None and not wandb.run.settings._offline:
                wandb.alert(title=f"straggler: {host}", text=text, level=wandb.AlertLevel.WARN)
        except Exception as e:  # an alert must not stop training
            logger.warning(f"wandb.alert failed: {e}")
