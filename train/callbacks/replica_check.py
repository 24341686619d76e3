"""The HSDP replica check (``health.consistency``) at its points: after the update every
``[training] consistency_every`` steps, and before every checkpoint save; a save after a passing
check is marked verified. Inactive without replicas (``[parallel] replicate`` 1)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan.config import Configurable

from train.callbacks.callback import Callback, TrainerView
from health.consistency import ReplicaVerifier
from health.phases import Phase


class ReplicaCheck(Callback[TrainerView], Configurable):
    name = "replica_check"
    priority = 200  # right after the update, before anything reads the weights
    phase = Phase.REPLICA_CHECK

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every: int = 100  # [training] consistency_every; 0: before saves only

    def __init__(self, config: Config, trainer: TrainerView):
        self.check: ReplicaVerifier | None = None
        if trainer.parallel_dims.dp_replicate_enabled:
            mesh = trainer.parallel_dims.get_mesh(["dp_replicate", "fsdp"]).mesh
            self.check = ReplicaVerifier(mesh, Path(trainer.config.dump_folder), config.every)
            trainer.checkpointer.prefer_verified = True  # resume from a checkpoint whose copies were compared

    def post_train_batch(self, trainer: TrainerView) -> None:
        if self.check is not None and self.check.due(trainer.step):
            self.check.run(trainer.step, trainer.model_parts, trainer.optimizers)

    def pre_checkpoint(self, trainer: TrainerView) -> None:
        if self.check is not None:  # a mismatch raises: nothing is saved
            self.check.run(trainer.step, trainer.model_parts, trainer.optimizers)

    def post_checkpoint_saved(self, trainer: TrainerView, path: Path) -> None:
        if self.check is not None and trainer.rank0:
            self.check.mark_verified(path, trainer.step)

    def state_dict(self) -> dict:
        return {"verified_step": self.check.verified_step if self.check else -1}

    def load_state_dict(self, state: dict) -> None:
        if self.check is not None:
            self.check.verified_step = int(state["verified_step"])
