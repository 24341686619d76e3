"""The phase comparison: what a phase did to the numbers it did not train for.

Llama 3 (arXiv 2407.21783, section 3.4.2) moves on from a long-context stage only once the short-context
evals have recovered. So for each listed run that started from another listed run's checkpoint
(``report.runs.continue_runs``): the held-out loss at the length the earlier run trained at (per held-out
set both scored, and over all of them when they scored the same sets) and CORE, before the phase (the
earlier run's last eval at or before the step the phase started from) and after it (the phase's last
eval). The phase's loss at the old length is ``eval/val_loss@<length>`` (``[eval] val_seq_lens``,
train.metric_names.at_length); a phase at the old length compares its plain ``eval/val_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from train.metric_names import VAL_LOSS, at_length, per_set
from report.runs import Run


@dataclass
class Comparison:
    run: str  # the phase
    parent: str  # the run it started from
    length: int  # the parent's seq_len: the short context
    before_step: int | None  # the parent's eval compared (None: it has none)
    after_step: int | None  # the phase's last eval
    rows: list[dict] = field(default_factory=list)  # metric, before, after, recovered
    note: str = ""


def comparisons(runs: list[Run]) -> list[Comparison]:
    """One per listed run that continues another listed run."""
    return [compare(run, *run.started_from) for run in runs if run.started_from]


def compare(run: Run, parent: Run, at: int) -> Comparison:
    """The short-context numbers of ``parent`` at step ``at`` (its last eval by then) and of ``run`` now."""
    before_step = max((s for s in parent.evals if s <= at), default=None)
    after_step = max(run.evals, default=None)
    before = parent.evals[before_step]["metrics"] if before_step is not None else {}
    after = run.evals[after_step]["metrics"] if after_step is not None else {}
    length = parent.seq_len
    keys = loss_keys(length, at_length(VAL_LOSS, length, parent.seq_len), at_length(VAL_LOSS, length, run.seq_len),
                     before, after) + core_keys(before, after)
    out = Comparison(run.name, parent.name, length, before_step, after_step)
    for label, b, a, lower_is_better in keys:
        recovered = None if b not in before or a not in after else \
            (after[a] <= before[b] if lower_is_better else after[a] >= before[b])
        out.rows.append({"metric": label, "before": before.get(b), "after": after.get(a), "recovered": recovered})
    if at_length(VAL_LOSS, length, run.seq_len) not in after:
        out.note = (f"{run.name}'s last eval has no held-out loss at {length:,}, the length {parent.name} trained at: "
                    f"add {length} to its [eval] val_seq_lens")
    return out


def loss_keys(length: int, before_key: str, after_key: str, before: dict, after: dict) -> list[tuple]:
    """(label, key before, key after, lower is better) of the held-out loss at ``length``: over every set
    when both runs scored the same sets (else the two means weigh other sets), then per set both scored; a
    phase that scored none at ``length`` gets the earlier run's rows, with nothing after."""
    sets_before = set_names(before, before_key)
    sets_after = set_names(after, after_key) or sets_before
    label = f"held-out loss at {length:,}"
    overall = [(label, before_key, after_key, True)] if sets_before == sets_after else []
    return overall + [(f"{label}: {name}", per_set(before_key, name), per_set(after_key, name), True)
                      for name in sorted(sets_before & sets_after)]


def set_names(metrics: dict, key: str) -> set[str]:
    """The held-out sets ``key`` (a validation loss name) has a per-set value of in ``metrics``."""
    prefix = per_set(key, "")
    return {k.removeprefix(prefix) for k in metrics if k.startswith(prefix)}


def core_keys(before: dict, after: dict) -> list[tuple]:
    """CORE's averages (eval.core: ``core/CORE_<v>``, ``core/partial_CORE_<v>``) both evals hold."""
    return [(k, k, k, False) for k in sorted(before.keys() & after.keys()) if k.startswith("core/") and "CORE_" in k]
