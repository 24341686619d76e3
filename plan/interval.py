"""The goodput-optimal checkpoint interval (Young/Daly) for a recipe on its cluster.

Between two checkpoints a failure loses, on average, half an interval of
training, plus the restart; every checkpoint costs its stall. With checkpoint
stall ``delta`` and the job's mean time between failures ``M`` (the per-node
MTBF over the nodes), the interval that wastes least is, to first order,
``sqrt(2 * delta * M)`` (J. W. Young, "A first order approximation to the
optimum checkpoint interval", CACM 17(9), 1974); Daly's higher-order estimate
("A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3), 2006, eq. 37) is printed beside it and used:
``sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + delta / 18M) - delta`` for
``delta < 2M``, else ``M``. The restart cost ``R`` does not move the optimum;
it enters the expected waste, ``delta / tau + (tau / 2 + R) / M`` (first order),
printed for the optimum and for the recipe's ``[checkpoint] interval``.

Inputs, each overridable in the recipe:

- ``[launch] node_mtbf_hours``: default 6,330 h per 8-GPU node, from Llama 3's
  419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al., "The
  Llama 3 Herd of Models", 2024, section 3.3.4): 419 / (54 x 24 h x 2,048 nodes);
- ``[launch] restart_s``: the planned restart (rendezvous, build, compile,
  checkpoint load); ``launch.slurm status`` measures it (``goodput``);
- ``[checkpoint] stall_s``: the measured stall per checkpoint (``goodput``'s
  checkpoints over the saves); else planned: async, ``ASYNC_STALL_S``, the
  blocking part measured at scale (a copy to host memory at a bus's peak would
  say milliseconds, but a save also collects garbage, flattens the state dict and
  plans across every rank); synchronous, the checkpoint's bytes per GPU
  (``health.storage.checkpoint_bytes``) written at ``WRITE_GBS_PER_NODE`` shared
  by a node's GPUs (an assumption: measure it with bench/checkpoint.py).

Step times are at ``MFU`` (train.py ``--dry-run``'s default), so an interval in
steps is about right when the run reaches that MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from health.storage import checkpoint_bytes

MFU = 0.40  # train.py --dry-run's default
# An async save blocked training 0.78 s at 1,856 H200s (TorchTitan, Llama3-70B, HSDP2: PyTorch's "6x faster
# Async Checkpointing in PyTorch", 2025). The background write's throughput dip after it (~67 s there) is not
# counted: measure [checkpoint] stall_s on the cluster.
ASYNC_STALL_S = 0.78
WRITE_GBS_PER_NODE = 2.0  # a node's share of the shared filesystem's write bandwidth


@dataclass
class Interval:
    stall_s: float
    stall_how: str
    mtbf_s: float  # the job's
    restart_s: float
    step_s: float
    interval_steps: int  # the recipe's

    @property
    def young_s(self) -> float:
        return math.sqrt(2 * self.stall_s * self.mtbf_s)

    @property
    def daly_s(self) -> float:
        d, m = self.stall_s, self.mtbf_s
        if d >= 2 * m:
            return m
        return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d

    def waste(self, tau: float) -> float:
        """Expected fraction of time lost to checkpoints, lost work and restarts (first order)."""
        return self.stall_s / tau + (tau / 2 + self.restart_s) / self.mtbf_s

    @property
    def best_steps(self) -> int:
        return max(1, round(self.daly_s / self.step_s))

    def lines(self) -> list[str]:
        now = self.interval_steps * self.step_s
        return [
            f"checkpoint interval (Young 1974 / Daly 2006): {self.best_steps:,} steps = {self.daly_s / 60:.0f} min "
            f"(Daly; Young's sqrt(2 x stall x MTBF): {self.young_s / 60:.0f} min) at {self.step_s:.2f} s/step "
            f"(MFU {MFU:.0%})",
            f"  inputs: checkpoint stall {self.stall_s:.2g} s ({self.stall_how}), job MTBF "
            f"{self.mtbf_s / 3600:.1f} h, restart {self.restart_s:.0f} s",
            f"  expected loss to failures and checkpoints: {self.waste(self.daly_s):.2%} at the optimum, "
            f"{self.waste(now):.2%} at the recipe's interval ({self.interval_steps:,} steps = {now / 60:.0f} min)",
        ]


def checkpoint_interval(recipe, speed, gpus: int, gpus_per_node: int, nparams: int) -> Interval:
    """The recipe's inputs, and the roofline ``speed`` for the step time, on ``gpus`` GPUs."""
    c, launch = recipe.checkpoint, recipe.launch
    per_gpu = checkpoint_bytes(nparams) / gpus
    if c.stall_s is not None:
        stall, how = c.stall_s, "measured: [checkpoint] stall_s"
    elif c.async_save:
        stall, how = ASYNC_STALL_S, "async: the blocking part measured at 1,856 H200s, PyTorch 2025"
    else:
        rate = WRITE_GBS_PER_NODE / gpus_per_node
        stall, how = per_gpu / (rate * 1e9), f"synchronous: {per_gpu / 1e9:.2f} GB/GPU at {rate:.2f} GB/s/GPU"
    nodes = max(1, math.ceil(gpus / gpus_per_node))
    step_s = speed.tokens_per_step * speed.flops_per_token / (speed.peak_flops * MFU)
    return Interval(stall, how, launch.node_mtbf_hours * 3600 / nodes, launch.restart_s, step_s, c.interval)
