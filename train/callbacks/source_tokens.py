"""At logging steps: tokens consumed per mixture source, to stdout and the metric loggers."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.callbacks.callback import Callback, TrainerView, at_logging_steps
from health.phases import Phase


class SourceTokens(Callback[TrainerView], Configurable):
    name = "source_tokens"
    priority = 100  # with the step's own metrics, before any eval of the step
    phase = Phase.METRICS

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, trainer: TrainerView):
        pass

    @at_logging_steps
    def post_step(self, trainer: TrainerView) -> None:
        consumed = trainer.dataloader.state_dict().get("consumed_tokens", {})
        if not consumed:  # a loader without sources' counts (a preference run's pairs)
            return
        trainer.metrics_processor.logger.log({f"data/tokens/{name}": n for name, n in consumed.items()}, trainer.step)
        logger.info("tokens per source: " + ", ".join(f"{k} {v:,}" for k, v in consumed.items()))
