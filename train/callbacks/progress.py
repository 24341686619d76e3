"""At logging steps: the progress line (step/total, tokens/total, ETA) and its metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.callbacks.callback import Callback, TrainerView, at_logging_steps
from health.phases import Phase


class Progress(Callback[TrainerView], Configurable):
    name = "progress"
    priority = 80  # after the spike guard's log of skips
    phase = Phase.METRICS

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, trainer: TrainerView):
        self.last: tuple[int, float] | None = None  # (step, time) at the last logging step

    @at_logging_steps
    def post_train_batch(self, trainer: TrainerView) -> None:
        t, now = trainer.config.training, time.perf_counter()
        line, metrics = progress(trainer.step, t.steps, t.global_batch_size * t.seq_len, self.last, now)
        self.last = (trainer.step, now)
        logger.info(line)
        if metrics:
            trainer.metrics_processor.logger.log(metrics, trainer.step)


def progress(step: int, steps: int, tokens_per_step: int, last: tuple[int, float] | None,
             now: float) -> tuple[str, dict[str, float]]:
    """The progress line of a logging step: step/total, tokens/total, ETA from the step time since
    the previous logging step (none at the first one: it includes start-up and compilation)."""
    line = (f"progress: step {step:,}/{steps:,} ({step / steps:.1%})  "
            f"tokens {_human(step * tokens_per_step)}/{_human(steps * tokens_per_step)}")
    metrics: dict[str, float] = {}
    if last and step > last[0]:
        per_step = (now - last[1]) / (step - last[0])
        eta = per_step * (steps - step)
        metrics = {"progress/step_time_s": per_step, "progress/eta_s": eta}
        line += f"  ETA {_duration(eta)} ({per_step:.3g} s/step)"
    return line, metrics


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


def _duration(seconds: float) -> str:
    d = timedelta(seconds=round(seconds))
    return f"{d.days}d {d.seconds // 3600}h {d.seconds // 60 % 60:02d}m" if d.days else str(d)
