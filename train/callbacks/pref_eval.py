"""A preference run's held-out pairs, before step 1 (logged as step 0), every ``[eval] every`` steps
and at the end: ``eval/pref_loss`` and ``eval/pref_accuracy`` (the share of pairs whose chosen reward
beats the rejected one). Step 0 is the baseline the curves start from: for ``dpo`` and ``dpo_norm``
the policy is the reference then, so the loss is ln 2 and no pair is won (ties).

The policy's log-probs are taken now; the reference's are those of the init checkpoint, computed
before step 1 with the training pairs' (train.preference.reference), never the trained policy's
(TRL #1148 took eval log-probs from the policy). Results go to the metric loggers and beside the
step's other evals in ``<run>/evals/step-<N>.json``.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass

import torch

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

import rundir
from train.callbacks.callback import Callback, LaneformerTrainer
from train.health.phases import Phase
from train.preference.loss import NEEDS_REFERENCE, preference_loss
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS
from train.preference.reference import pair_logps


class PrefEval(Callback, Configurable):
    name = "pref_eval"
    priority = -1  # after the eval callback (0) writes the step's evals file (its results are added to it)
    phase = Phase.EVAL

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every: int = 0  # steps; 0: only at the end
        at_end: bool = True

    def __init__(self, config: Config, trainer: LaneformerTrainer):
        self.config = config

    def pre_train(self, trainer: LaneformerTrainer) -> None:
        if trainer.step == 0:  # not a resumed run: it has its baseline
            self.run(trainer, 0)

    def post_step(self, trainer: LaneformerTrainer) -> None:
        c, step = self.config, trainer.step
        if (c.every and step % c.every == 0) or (c.at_end and step == trainer.config.training.steps):
            self.run(trainer, step)

    def run(self, trainer: LaneformerTrainer, step: int) -> None:
        """Evaluate, log and add the results to the step's evals file."""
        try:  # an eval never stops training (train.callbacks.eval)
            results = self.evaluate(trainer)
        except Exception as e:
            logger.error(f"held-out pairs at step {step} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return
        trainer.metrics_processor.logger.log(results, step)
        if trainer.rank0:
            logger.info(f"held-out pairs at step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))
            out = rundir.eval_file(trainer.config.dump_folder, step)
            out.parent.mkdir(parents=True, exist_ok=True)
            old = json.loads(out.read_text()) if out.is_file() else {"step": step, "metrics": {}, "errors": []}
            old["metrics"].update(results)
            out.write_text(json.dumps(old, indent=2) + "\n")

    @staticmethod
    def evaluate(trainer: LaneformerTrainer) -> dict[str, float]:
        t = trainer.config
        policy = torch.from_numpy(pair_logps(trainer.model_parts[0], trainer.heldout_pairs, trainer.local_pairs,
                                             trainer.average, trainer.device)).double()
        ref = trainer.reference["heldout"].double().cpu() if NEEDS_REFERENCE[t.loss_type] else None
        losses, chosen, rejected = preference_loss(
            t.loss_type, t.beta, policy[:, 0], policy[:, 1], None if ref is None else ref[:, 0],
            None if ref is None else ref[:, 1], label_smoothing=t.label_smoothing, gamma=t.gamma)
        return {EVAL_LOSS: float(losses.mean()), EVAL_ACCURACY: float((chosen > rejected).double().mean())}
