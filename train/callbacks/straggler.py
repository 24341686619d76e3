"""The straggler check (``health.straggler``) at logging steps, after the step's save.

Every rank times the fixed GEMM alone and adds its data wait since the last logging step; the
ranks all-gather the two numbers over the bookkeeping group (gloo, host tensors: no device sync) and
every rank counts the same streaks, so the checkpointed streaks are the same whichever rank's
copy DCP keeps. Rank 0 logs ``straggler/*`` and raises the alert.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.callbacks.callback import Callback, TrainerView, at_logging_steps, bookkeeping_group
from health.alerts import write_alert
from health.phases import Phase
from health.straggler import GEMM, Streaks, gemm_seconds, others_median


class Straggler(Callback[TrainerView], Configurable):
    name = "straggler"
    priority = 90  # with the step's metrics (after the source tokens), before evals
    phase = Phase.STRAGGLER

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        threshold: float = 0.2  # [launch] straggler_threshold: slower than the others' median by this fraction
        windows: int = 5  # [launch] straggler_windows: logging steps in a row

    def __init__(self, config: Config, trainer: TrainerView):
        self.config = config
        self.streaks = Streaks(config.threshold, config.windows)
        self.hosts: list[str] = []
        self.data_seen = 0.0

    def _setup(self, trainer: TrainerView) -> None:
        kind = "cuda" if trainer.device.type == "cuda" else "cpu"
        n, self.reps = GEMM[kind]
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        self.a = torch.full((n, n), 1.0 / n, device=trainer.device, dtype=dtype)
        self.b = torch.eye(n, device=trainer.device, dtype=dtype)
        self.hosts = [""] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname(), group=bookkeeping_group())

    @at_logging_steps
    def post_step(self, trainer: TrainerView) -> None:
        group = bookkeeping_group()
        if group is None:  # one rank: no one to wait for
            return
        if not self.hosts:
            self._setup(trainer)
        mine = [gemm_seconds(self.a, self.b, self.reps), trainer.data_wait_s - self.data_seen]
        self.data_seen = trainer.data_wait_s
        everyone = [torch.zeros(2, dtype=torch.float64) for _ in self.hosts]
        dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64), group=group)
        compute, data = [t[0].item() for t in everyone], [t[1].item() for t in everyone]
        named = self.streaks.judge(compute)
        if trainer.rank0:
            self._log(trainer, compute, data)
            for rank in named:
                self._alert(trainer, rank, compute[rank], others_median(compute, rank))

    def _log(self, trainer: TrainerView, compute: list[float], data: list[float]) -> None:
        slowest = max(range(len(compute)), key=compute.__getitem__)
        # Numbers only (tensorboard takes scalars): a host is named in the key of its compute time.
        trainer.metrics_processor.logger.log({
            "straggler/compute_min_s": min(compute), "straggler/compute_median_s": statistics.median(compute),
            "straggler/compute_max_s": compute[slowest], "straggler/slowest_rank": slowest,
            "straggler/data_wait_median_s": statistics.median(data), "straggler/data_wait_max_s": max(data),
            **{f"straggler/compute_s/{host}": max(c for c, h in zip(compute, self.hosts) if h == host)
               for host in set(self.hosts)}}, trainer.step)

    def _alert(self, trainer: TrainerView, rank: int, seconds: float, median: float) -> None:
        host, c = self.hosts[rank], self.config
        text = (f"rank {rank} on {host} is a straggler: its compute check took {seconds * 1e3:.1f} ms, "
                f"{seconds / median - 1:.0%} over the other ranks' median {median * 1e3:.1f} ms, for {c.windows} logging steps "
                f"in a row (up to step {trainer.step}; [launch] straggler_threshold {c.threshold:g})")
        logger.warning(f"STRAGGLER: {text}")
        write_alert(Path(trainer.config.dump_folder), "straggler", trainer.step, text, rank=rank, host=host,
                    compute_s=seconds, median_s=median)
        try:
            import wandb
            from wandb.sdk.wandb_alerts import AlertLevel

            if (run := wandb.run) is not None and not run.settings._offline:
                run.alert(title=f"straggler: {host}", text=text, level=AlertLevel.WARN)
        except Exception as e:  # an alert must not stop training
            logger.warning(f"wandb.alert failed: {e}")

    def state_dict(self) -> dict:
        return self.streaks.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.streaks.load_state_dict(state)
