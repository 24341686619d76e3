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
``phase`` (``health.phases.Phase``: what its rank's heartbeat says while it runs, so what the
stall watchdog allows it and where goodput books its time). They are called in (-priority, name)
order, the same on every rank. A callback with state saves it with the checkpoint
(``state_dict``/``load_state_dict``, JSON-able, equal on every rank), so a restart continues its
counts instead of starting them again.

A point is handed the trainer as a typed view, as OLMo-core types the trainer its callbacks see:
``TrainerView`` names everything a callback may read or call (the run's objective among it, whatever
kind it is: train.objectives); a callback is a ``Callback[TrainerView]``, and mypy (``make test``) fails
one that reaches past its view. Two rules are defined here once: a point that
acts only at logging steps is marked ``at_logging_steps``, and host-side agreement between ranks
goes over ``bookkeeping_group``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.configs import TrainingConfig
from torchtitan.distributed import ParallelDims

from data.loader import BatchLoaderSlot, SentencePieceTokenizer
from health.heartbeat import Heartbeat
from health.phases import Phase
from train.objectives import TrainerParts

POINTS = ("pre_train", "pre_step", "pre_optim_step", "post_train_batch", "pre_checkpoint", "post_checkpoint_saved",
          "post_step", "post_train", "on_error")


class ObjectiveView(Protocol):
    """What a callback may use of the run's objective (train.objectives.base.Objective, which derives from
    torchtitan's loss, so mypy reads it as Any: named here, what a callback reaches past is a type error)."""

    @property
    def name(self) -> str: ...  # its kind, as train.recipe.objective names it

    @property
    def evaluates(self) -> bool: ...  # whether it has a held-out evaluation of its own in this run

    @property
    def eval_name(self) -> str: ...

    def evaluate(self, trainer: TrainerParts) -> dict[str, float]: ...


class RunConfig(Protocol):
    """What a callback reads of the trainer's config: the run dir and torchtitan's ``[training]``."""

    @property
    def dump_folder(self) -> str: ...

    @property
    def training(self) -> TrainingConfig: ...


@runtime_checkable
class TrainerView(Protocol):
    """The trainer as a callback sees it: everything a callback may read or call, read-only (the trainer,
    ``train.trainer.LaneformerTrainer``, stands above this room, so it is named by this contract, never
    imported). A path not named here fails the type check (``make test``); a new need adds it here, so
    the trainer's rewrite knows what it must keep. Checkable at run time (``isinstance``): the trainer
    derives from torchtitan's, which mypy reads as Any, so only a real trainer shows it has every name."""

    @property
    def step(self) -> int: ...  # the step in progress (after it, the step done)

    @property
    def config(self) -> RunConfig: ...

    @property
    def rank0(self) -> bool: ...  # whether this rank writes the run's shared files

    @property
    def device(self) -> torch.device: ...

    @property
    def model_parts(self) -> list[torch.nn.Module]: ...

    @property
    def optimizers(self) -> OptimizersContainer: ...  # train.titan.GuardedOptimizers: ``skip`` is the guard's

    @property
    def checkpointer(self) -> CheckpointManager: ...  # train.titan.MilestoneCheckpointManager

    @property
    def metrics_processor(self) -> MetricsProcessor: ...  # train.titan.LaneformerMetrics: ``logger`` logs

    @property
    def parallel_dims(self) -> ParallelDims: ...

    @property
    def dataloader(self) -> BatchLoaderSlot: ...

    @property
    def tokenizer(self) -> SentencePieceTokenizer: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    @property
    def callbacks(self) -> Callbacks: ...  # one callback reading another's state (the rollback, the guard's)

    @property
    def objective(self) -> ObjectiveView: ...  # the run's loss (train.objectives): its own evaluation, its kind

    @property
    def step_loss(self) -> torch.Tensor | None: ...  # the step's global loss, from pre_optim_step on

    @property
    def grad_norm(self) -> torch.Tensor | None: ...  # the step's pre-clip norm, from pre_optim_step on

    @property
    def data_wait_s(self) -> float: ...  # seconds this rank waited for batches so far

    def enter(self, phase: Phase) -> None:
        """This rank enters ``phase``: its heartbeat says so."""

    def save_checkpoint(self, last_step: bool = False) -> None:
        """The loop's save of this step, between the ``pre_checkpoint`` and ``post_checkpoint_saved``
        callbacks (``last_step``: torchtitan's forced save, a preemption's)."""


# The view a callback is written against.
View = TypeVar("View", bound=TrainerView, contravariant=True)
Hook = TypeVar("Hook", bound=Callable[..., None])
LOGGING_STEPS = "_at_logging_steps"


def at_logging_steps(hook: Hook) -> Hook:
    """Run a point's ``hook`` only at logging steps (``metrics_processor.should_log``: where the step's
    loss is read anyway, so what the callback reads and logs adds no host sync to the other steps).
    The one gate of every callback that logs, asked once per point by ``Callbacks.call``."""
    setattr(hook, LOGGING_STEPS, True)
    return hook


def bookkeeping_group() -> dist.ProcessGroup | None:
    """The ranks' group for the callbacks' host-side agreements (the preemption flag, the straggler's
    timings, the export's errors): gloo, so agreeing needs no device sync. One per process group
    (OLMo-core's bookkeeping group), made by its first user at the same point on every rank (making a
    group is collective); None without other ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    world = dist.group.WORLD
    if world not in _bookkeeping:
        group = dist.new_group(backend="gloo")
        assert isinstance(group, dist.ProcessGroup)  # every rank is a member
        _bookkeeping[world] = group
    return _bookkeeping[world]


_bookkeeping: dict[Any, dist.ProcessGroup] = {}  # the world's group -> its own: a new world gets a new one


class Callback(Generic[View]):
    name: ClassVar[str]  # its key in the checkpoint and in the README's table
    priority: ClassVar[int] = 0
    phase: ClassVar[Phase]

    def pre_train(self, trainer: View) -> None:
        """Once per launch, after the checkpoint load, before the first step."""

    def pre_step(self, trainer: View) -> None:
        """A step begins (``trainer.step`` is its number), before its data is read."""

    def pre_optim_step(self, trainer: View) -> None:
        """After forward/backward and clipping, before the optimizer update."""

    def post_train_batch(self, trainer: View) -> None:
        """After the optimizer update, before the step's checkpoint save."""

    def pre_checkpoint(self, trainer: View) -> None:
        """Before any checkpoint save; raising saves nothing."""

    def post_checkpoint_saved(self, trainer: View, path: Path) -> None:
        """After a save of ``path`` (an async save may still be writing)."""

    def post_step(self, trainer: View) -> None:
        """After the step and its checkpoint save."""

    def post_train(self, trainer: View) -> None:
        """Once, after the loop's final checkpoint save."""

    def on_error(self, trainer: View, error: Exception) -> None:
        """Training stops on ``error`` (it is raised again after every callback's on_error)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Callbacks:
    """The run's callbacks in calling order, and the one place that calls a point."""

    def __init__(self, callbacks: list[Callback[Any]], enter: Callable[[Phase], None]):
        names = [c.name for c in callbacks]
        if len(set(names)) != len(names):
            raise ValueError(f"two callbacks share a name: {sorted(names)}")
        self.all = sorted(callbacks, key=lambda c: (-c.priority, c.name))
        self.enter = enter  # the trainer's: its heartbeat enters the callback's phase

    def get(self, name: str) -> Callback[Any]:
        """The callback called ``name`` (one callback reading another's state, e.g. the rollback the guard's)."""
        return next(c for c in self.all if c.name == name)

    def at(self, point: str) -> list[Callback[Any]]:
        """The callbacks that act at ``point`` (that override it), in calling order."""
        return [c for c in self.all if getattr(type(c), point) is not getattr(Callback, point)]

    def call(self, point: str, trainer: TrainerView, *args: Any, then: Phase | None = None) -> None:
        """Call ``point`` on every callback acting there, each under its phase (those ``at_logging_steps``
        only at a logging step); ``then``: the phase to go back to afterwards (a point inside the
        trainer's own phase, such as a save; after the step, what runs until the next one), so a phase
        holds only its callback's own time."""
        acting = self.at(point)
        gated = [c for c in acting if getattr(getattr(type(c), point), LOGGING_STEPS, False)]
        if gated and not trainer.metrics_processor.should_log(trainer.step):
            acting = [c for c in acting if c not in gated]
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

    def call_on_error(self, trainer: TrainerView, error: Exception) -> None:
        """``on_error`` on every callback acting there; one that fails is logged, never replaces ``error``."""
        for callback in self.at("on_error"):
            try:
                self.enter(callback.phase)
                callback.on_error(trainer, error)
            except Exception as e:  # the run's own error is what the launcher must see
                print(f"warning: callback {callback.name}'s on_error failed: {type(e).__name__}: {e}", file=sys.stderr)
