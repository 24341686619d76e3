"""The callback: side effects of training hung off the trainer at named points of a step.

As OLMo-core's callbacks (``olmo_core/train/callbacks/callback.py``): a callback overrides the
points it needs, each a no-op here. ``LaneformerTrainer`` calls the points in this order (the
README's "One step, in order" table lists who runs at each):

- ``pre_train``: once per launch, after the checkpoint load, before the first step;
- ``pre_step``: a step begins, before its data is read;
- ``pre_optim_step``: after forward/backward and clipping (``trainer.grad_norm`` holds the pre-clip
  norm, ``trainer.step_loss`` the global loss), before the optimizer update;
- ``post_train_batch``: after the update, before the step's checkpoint save;
- ``pre_checkpoint`` / ``post_checkpoint_saved(path)``: around every save (the loop's, a
  preemption's, the final one);
- ``post_step``: after the step and its save, so whatever a callback does at step N (an eval, a
  preemption exit, a rollback) happens with step N safe on disk;
- ``post_train``: once, after the loop's final save;
- ``on_error(error)``: training stopped on an exception (not a preemption).

Each callback has a ``name`` (its key in the checkpoint), a ``priority`` (higher first) and a
``phase`` (``train.health.phases.Phase``: what its rank's heartbeat says while it runs, so what the
stall watchdog allows it and where goodput books its time). They are called in (-priority, name)
order, the same on every rank. A callback with state saves it with the checkpoint
(``state_dict``/``load_state_dict``, JSON-able, equal on every rank), so a restart continues its
counts instead of starting them again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar

from train.health.phases import Phase

# The trainer every point is handed: train.trainer.LaneformerTrainer. It stands above this room (it calls
# the callbacks), so it is named here for the annotations, never imported (tests/test_layers.py).
LaneformerTrainer = Any

POINTS = ("pre_train", "pre_step", "pre_optim_step", "post_train_batch", "pre_checkpoint", "post_checkpoint_saved",
          "post_step", "post_train", "on_error")


class Callback:
    name: ClassVar[str]  # its key in the checkpoint and in the README's table
    priority: ClassVar[int] = 0
    phase: ClassVar[Phase]

    def pre_train(self, trainer: LaneformerTrainer) -> None:
        """Once per launch, after the checkpoint load, before the first step."""

    def pre_step(self, trainer: LaneformerTrainer) -> None:
        """A step begins (``trainer.step`` is its number), before its data is read."""

    def pre_optim_step(self, trainer: LaneformerTrainer) -> None:
        """After forward/backward and clipping, before the optimizer update."""

    def post_train_batch(self, trainer: LaneformerTrainer) -> None:
        """After the optimizer update, before the step's checkpoint save."""

    def pre_checkpoint(self, trainer: LaneformerTrainer) -> None:
        """Before any checkpoint save; raising saves nothing."""

    def post_checkpoint_saved(self, trainer: LaneformerTrainer, path: Path) -> None:
        """After a save of ``path`` (an async save may still be writing)."""

    def post_step(self, trainer: LaneformerTrainer) -> None:
        """After the step and its checkpoint save."""

    def post_train(self, trainer: LaneformerTrainer) -> None:
        """Once, after the loop's final checkpoint save."""

    def on_error(self, trainer: LaneformerTrainer, error: Exception) -> None:
        """Training stops on ``error`` (it is raised again after every callback's on_error)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Callbacks:
    """The run's callbacks in calling order, and the one place that calls a point."""

    def __init__(self, callbacks: list[Callback], enter: Callable[[Phase], None]):
        names = [c.name for c in callbacks]
        if len(set(names)) != len(names):
            raise ValueError(f"two callbacks share a name: {sorted(names)}")
        self.all = sorted(callbacks, key=lambda c: (-c.priority, c.name))
        self.enter = enter  # the trainer's: its heartbeat enters the callback's phase

    def get(self, name: str) -> Callback:
        """The callback called ``name`` (one callback reading another's state, e.g. the rollback the guard's)."""
        return next(c for c in self.all if c.name == name)

    def at(self, point: str) -> list[Callback]:
        """The callbacks that act at ``point`` (that override it), in calling order."""
        return [c for c in self.all if getattr(type(c), point) is not getattr(Callback, point)]

    def call(self, point: str, trainer: LaneformerTrainer, *args, then: Phase | None = None) -> None:
        """Call ``point`` on every callback acting there, each under its phase; ``then``: the phase
        to go back to afterwards (a point inside the trainer's own phase, such as a save; after the
        step, what runs until the next one), so a phase holds only its callback's own time."""
        acting = self.at(point)
        for callback in acting:
            self.enter(callback.phase)
            getattr(callback, point)(trainer, *args)
        if then is not None and acting:
            self.enter(then)

    def state_json(self) -> str:
        """Every stateful callback's state, by name, as one JSON string: one checkpoint key (DCP stores a
        string as an opaque object) whichever callbacks a run has, so adding or dropping one never
        makes a checkpoint unloadable."""
        return json.dumps({c.name: c.state_dict() for c in self.all if type(c).state_dict is not Callback.state_dict})

    def load_state_json(self, text: str) -> None:
        """Restore what ``state_json`` wrote; a callback it does not name keeps its fresh state."""
        state = json.loads(text)
        for c in self.all:
            if c.name in state:
                c.load_state_dict(state[c.name])

    def call_on_error(self, trainer: LaneformerTrainer, error: Exception) -> None:
        """``on_error`` on every callback acting there; one that fails is logged, never replaces ``error``."""
        for callback in self.at("on_error"):
            try:
                self.enter(callback.phase)
                callback.on_error(trainer, error)
            except Exception as e:  # the run's own error is what the launcher must see
                print(f"warning: callback {callback.name}'s on_error failed: {type(e).__name__}: {e}", file=sys.stderr)
