"""The heartbeat's marks and counts: a step begins, the first step is done, the steps done.

The trainer's ``Heartbeat`` (``health.heartbeat``) is made before anything else, so a stall
while building is seen too, and every phase a rank enters is beaten through it
(the trainer's ``enter``); this callback adds what the watchdog and goodput read about steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config import Configurable

from train.callbacks.callback import Callback, TrainerView
from health.phases import Phase


class HeartbeatMarks(Callback[TrainerView], Configurable):
    name = "heartbeat"
    priority = 1000  # first at every point: a step's phases begin with its number
    phase = Phase.DATA  # a step begins with its data (at post_train_batch it only counts, before the next callback)

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, trainer: TrainerView):
        self.beats = trainer.heartbeat

    def pre_train(self, trainer: TrainerView) -> None:
        self.beats.mark("loaded")

    def pre_step(self, trainer: TrainerView) -> None:
        """Nothing more: entering this callback's phase with the new step's number is the beat."""

    def post_train_batch(self, trainer: TrainerView) -> None:
        self.beats.mark("first_step")  # this launch's first update is applied
        self.beats.step_done()
