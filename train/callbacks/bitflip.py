"""A test-only fault: ``LANEFORMER_TEST_BITFLIP=RANK:STEP[:TARGET]`` flips bit 12 of the first word of
that rank's first non-empty local shard of TARGET after that step's update, so the replica check
(``train.callbacks.replica_check``, which runs right after) has a silent corruption to find. TARGET is
``params`` (the default: a parameter) or ``optimizer`` (AdamW's first moment, ``exp_avg``, or Muon's
``momentum_buffer``: state the loss does not show until a later update reads it). The rank places the fault in its replica group
(``health.consistency``: ``[replicate, shard]`` mesh, a group per shard).
``train.build`` adds this callback only when the variable is set: a real run never calls it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.config import Configurable

from train.callbacks.callback import Callback, TrainerView
from health.consistency import WORDS, local
from health.phases import Phase

BITFLIP_ENV = "LANEFORMER_TEST_BITFLIP"
TARGETS = ("params", "optimizer")


class BitFlip(Callback[TrainerView], Configurable):
    name = "test_bitflip"
    priority = 300  # before the replica check
    phase = Phase.REPLICA_CHECK

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        spec: str  # RANK:STEP[:TARGET]

    def __init__(self, config: Config, trainer: TrainerView):
        rank, step, *target = config.spec.split(":")
        self.rank, self.step, self.target = int(rank), int(step), (target or ["params"])[0]
        if self.target not in TARGETS or len(target) > 1:
            raise ValueError(f"{BITFLIP_ENV}={config.spec}: expected RANK:STEP[:{'|'.join(TARGETS)}]")

    def post_train_batch(self, trainer: TrainerView) -> None:
        if (dist.get_rank(), trainer.step) == (self.rank, self.step):
            if self.target == "params":
                flipped = flip_bit(p for m in trainer.model_parts for p in m.parameters())
            else:
                flipped = flip_bit(s["exp_avg"] if "exp_avg" in s else s["momentum_buffer"]
                                   for opt in trainer.optimizers.optimizers for s in opt.state.values())
            if not flipped:
                raise RuntimeError(f"{BITFLIP_ENV}: rank {self.rank} holds no {self.target} to flip")


def flip_bit(tensors) -> bool:
    """Flip bit 12 of the first word of the first non-empty local shard of ``tensors``; True if one was flipped."""
    with torch.no_grad():
        for t in tensors:
            shard = local(t.data)
            if shard.numel():
                words = shard.view(-1).view(WORDS[shard.element_size()])
                words[0] ^= 1 << 12
                return True
    return False
