"""Side effects of training, hung off the trainer at named points of its loop, in an explicit order.

A ``Hook`` overrides the points it needs; ``LaneformerTrainer`` calls every hook at
every point, higher ``priority`` first (OLMo-core's callback rule):

- ``after_step(trainer)``: after step N *and* torchtitan's checkpoint save of
  step N (when one was due), so whatever a hook does at step N (an eval, a
  preemption exit) happens with step N safe on disk;
- ``after_train(trainer)``: once, after the loop, with the final checkpoint on disk.

``MetricsJsonl`` is a torchtitan metric logger (beside tensorboard and wandb)
that appends every logged metric dict to ``<run>/metrics.jsonl``, flushed per
line, so a killed run keeps its numbers and tests can compare runs exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torchtitan.components.metrics import BaseLogger
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from train.trainer import LaneformerTrainer


class Hook:
    """Base of every hook: each point is a no-op until overridden."""

    priority: ClassVar[int] = 0  # higher runs first at every point; ties keep the recipe's order

    @property
    def phase(self) -> str:
        """This hook's phase in the rank's heartbeat (train.health.heartbeat): EvalHook -> ``eval``."""
        return type(self).__name__.removesuffix("Hook").lower()

    def after_step(self, trainer: LaneformerTrainer) -> None:
        """After the step and its checkpoint save (if one was due)."""

    def after_train(self, trainer: LaneformerTrainer) -> None:
        """Once, after the loop's final checkpoint save."""


def in_order(hooks: list[Hook]) -> list[Hook]:
    """``hooks`` in calling order: higher priority first, stable among equals."""
    return sorted(hooks, key=lambda h: -h.priority)


class MetricsJsonl(BaseLogger):
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class LogSourceTokens(Hook):
    """At log steps: tokens consumed per mixture source, to stdout and the metric loggers."""

    priority = 100  # with the step's own metrics, before any eval of the step

    def after_step(self, trainer: LaneformerTrainer) -> None:
        if not trainer.metrics_processor.should_log(trainer.step):
            return
        consumed = trainer.dataloader.state_dict().get("consumed_tokens", {})
        trainer.metrics_processor.logger.log(
            {f"data/tokens/{name}": n for name, n in consumed.items()}, trainer.step
        )
        logger.info("tokens per source: " + ", ".join(f"{k} {v:,}" for k, v in consumed.items()))
