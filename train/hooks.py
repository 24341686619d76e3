"""Side effects of training, hung off the trainer: each is a small object called after a step
(``after_step``) and, optionally, once after the final checkpoint is saved (``after_train``).

``MetricsJsonl`` is a torchtitan metric logger (beside tensorboard and wandb)
that appends every logged metric dict to ``<run>/metrics.jsonl``, flushed per
line, so a killed run keeps its numbers and tests can compare runs exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rundir import read_metrics
from torchtitan.components.metrics import BaseLogger
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from train.trainer import LaneformerTrainer


class Hook(Protocol):
    """Has ``after_step(trainer)``, ``after_train(trainer)`` or both."""


def last_logged(run: Path, key: str) -> tuple[int, float] | None:
    """(step, value) of the last ``key`` in a run's metrics.jsonl, or None."""
    rows = [row for row in read_metrics(run) if key in row]
    return (rows[-1]["step"], rows[-1][key]) if rows else None


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


class LogSourceTokens:
    """At log steps: tokens consumed per mixture source, to stdout and the metric loggers."""

    def after_step(self, trainer: LaneformerTrainer) -> None:
        if not trainer.metrics_processor.should_log(trainer.step):
            return
        consumed = trainer.dataloader.state_dict().get("consumed_tokens", {})
        trainer.metrics_processor.logger.log(
            {f"data/tokens/{name}": n for name, n in consumed.items()}, trainer.step
        )
        logger.info("tokens per source: " + ", ".join(f"{k} {v:,}" for k, v in consumed.items()))
