"""What a sweep can be compared on: each metric's direction, and whether its numbers are on the scale of
the run's own loss function (torch- and scipy-free: launch.sweep checks a sweep file's ``metric`` with it).

A preference run's training loss and held-out ``eval/pref_loss`` are its own objective: ``dpo`` sums
log-probs, ``dpo_norm`` averages them (~length times smaller), ``simpo`` has no reference and a margin,
and beta scales every one. Two runs that differ in any of those are not on one scale, so such a metric
is compared only across runs that share it (``loss_scale``). Held-out preference accuracy (the share of
pairs whose chosen reward beats the rejected one) and validation loss (next-token cross-entropy on
held-out text) mean the same whatever the run trained with.
"""

from __future__ import annotations

from dataclasses import dataclass

from train.metric_names import VAL_BPB, VAL_LOSS
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS
from train.recipe.objective import PREFERENCE, objective_of

TRAIN = "loss_metrics/global_avg_loss"  # torchtitan's name; a preference run logs its preference loss there


@dataclass(frozen=True)
class Metric:
    key: str  # as metrics.jsonl names it
    label: str  # as the report prints it
    higher_is_better: bool
    own_scale: bool  # on the scale of the run's loss function: compared only across runs with one loss_scale


METRICS = {m.key: m for m in (
    Metric(VAL_LOSS, "validation loss", False, False),
    Metric(VAL_BPB, "validation bits per byte", False, False),
    Metric(EVAL_ACCURACY, "held-out preference accuracy", True, False),
    Metric(EVAL_LOSS, "held-out preference loss", False, True),
    Metric(TRAIN, "training loss", False, True),
)}


def default_metric(recipes: list[dict]) -> Metric:
    """Without a ``metric`` in the sweep file: held-out preference accuracy for preference runs (the one
    preference number on every loss type's scale), validation loss otherwise."""
    return METRICS[EVAL_ACCURACY if any(objective_of(r) == PREFERENCE for r in recipes) else VAL_LOSS]


def loss_scale(recipe: dict) -> dict:
    """The resolved recipe's settings that set its loss's scale: a preference run's loss type, beta and
    label smoothing, and SimPO's margin gamma (the others ignore it); next-token cross-entropy's: no loss type."""
    if objective_of(recipe) != PREFERENCE:
        return {"preference.loss": "unset"}
    pref = recipe["preference"]
    keys = ("loss", "beta", "label_smoothing", *(("gamma",) if pref["loss"] == "simpo" else ()))
    return {f"preference.{k}": pref.get(k) for k in keys}


def scale_difference(recipes: list[dict]) -> str:
    """Why the recipes' losses are not on one scale: each setting whose values differ among the runs that
    have it, with those values; "" when they are on one."""
    scales = [loss_scale(r) for r in recipes]
    keys = dict.fromkeys(k for s in scales for k in s)
    values = {k: list(dict.fromkeys(s[k] for s in scales if k in s)) for k in keys}
    return "; ".join(f"{k} {', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in vs)}"
                     for k, vs in values.items() if len(vs) > 1)
