"""``<run>/metrics.jsonl``: every logged metric dict, one JSON line each, flushed per line.

``MetricsJsonl`` is a torchtitan metric logger beside tensorboard and wandb, so a killed run keeps
its numbers, the report and ``rundir.read_metrics`` read them, and tests compare runs exactly. The
callback hangs it on rank 0's logger before the first step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.metrics import BaseLogger, LoggerContainer
from torchtitan.config import Configurable

from rundir import METRICS_FILE
from train.callbacks.callback import Callback, TrainerView
from health.phases import Phase


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


class MetricsFile(Callback[TrainerView], Configurable):
    name = "metrics_file"
    priority = 1000  # before anything logs
    phase = Phase.METRICS

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, trainer: TrainerView):
        pass

    def pre_train(self, trainer: TrainerView) -> None:
        if not trainer.rank0:
            return
        metrics = trainer.metrics_processor
        if not isinstance(metrics.logger, LoggerContainer):  # no tensorboard, no wandb
            metrics.logger = LoggerContainer()
        metrics.logger.add_logger(MetricsJsonl(Path(trainer.config.dump_folder) / METRICS_FILE))
