"""A test-only fault: ``LANEFORMER_TEST_BITFLIP=RANK:STEP`` flips bit 12 of the first word of that
rank's first non-empty parameter shard after that step's update, so the replica check
(``train.callbacks.replica_check``, which runs right after) has a silent corruption to find.
``train.build`` adds this callback only when the variable is set: a real run never calls it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.config import Configurable

from train.callbacks.callback import Callback, LaneformerTrainer
from train.health.consistency import WORDS, local
from train.health.phases import Phase

BITFLIP_ENV = "LANEFORMER_TEST_BITFLIP"


class BitFlip(Callback, Configurable):
    name = "test_bitflip"
    priority = 300  # before the replica check
    phase = Phase.REPLICA_CHECK

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        spec: str  # RANK:STEP

    def __init__(self, config: Config, trainer: LaneformerTrainer):
        self.rank, self.step = (int(x) for x in config.spec.split(":"))

    def post_train_batch(self, trainer: LaneformerTrainer) -> None:
        if (dist.get_rank(), trainer.step) == (self.rank, self.step):
            flip_bit(trainer.model_parts)


def flip_bit(model_parts) -> bool:
    """Flip bit 12 of the first word of the first non-empty local parameter shard; True if one was flipped."""
    with torch.no_grad():
        for model in model_parts:
            for p in model.parameters():
                shard = local(p.data)
                if shard.numel():
                    words = shard.view(-1).view(WORDS[shard.element_size()])
                    words[0] ^= 1 << 12
                    return True
    return False
