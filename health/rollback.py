"""Spike rollback: spikes that keep coming back are rolled back, and the data around them skipped.

The step guard (``health.guard``) skips a spiking step, and 100 skips in a row stop the run
(OLMo-core's rule). A spike that comes back a few steps later means the weights have already
drifted to where this stretch of data spikes them; PaLM's remedy (Chowdhery et al. 2022, "PaLM:
Scaling Language Modeling with Pathways", sec. 5.1: restart from a checkpoint about 100 steps
before the spike and skip about 200-500 data batches) is taken here in-process:

- when ``[training] spike_rollbacks`` skipped steps come within ``[training] spike_window`` steps
  (seen at a logging step, where the guard's counters are read anyway: no extra host sync),
- the trainer loads the latest complete checkpoint saved before the first of them (weights, AdamW
  state, schedule, guard, data position), moves the checkpoints saved after it aside
  (``step-N.rolled-back``: a restart must not resume from them),
- and the data loader goes on from the sample it had reached (``MixtureLoader.skip_to``): the
  batches seen between that checkpoint and now are never trained on again, nor counted as consumed
  (so the logged and reported mix stays what the model saw).

The trainer's side (the load, the data skip) is ``train.callbacks.rollback``; this module holds the
rules and the record. Each rollback is a line of ``<run>/rollbacks.jsonl`` (the steps, the skipped global samples and
their tokens per source), which the run report marks. Without a checkpoint before the spikes
nothing is rolled back: the guard goes on skipping.
"""

from __future__ import annotations

import json
from pathlib import Path

from rundir import STEP_DIR, is_complete, read_jsonl, rollbacks_file, step_number


def due(recent: tuple[int, ...], spikes: int, window: int) -> bool:
    """Whether the latest ``spikes`` skipped steps (``recent``, oldest first) came within ``window`` steps."""
    return spikes > 0 and len(recent) >= spikes and recent[-1] - recent[-spikes] < window


def checkpoint_before(folder: Path, step: int) -> int | None:
    """The latest complete checkpoint's step before ``step``, if any."""
    steps = [n for p in Path(folder).glob(STEP_DIR.format(step="*")) if (n := step_number(p)) is not None and n < step and is_complete(p)]
    return max(steps, default=None)


def set_aside_after(folder: Path, step: int) -> None:
    """Rename the checkpoints saved after ``step`` to ``step-N.rolled-back[-k]``: a restart must not
    resume from them, and a person can still look at them."""
    for later in Path(folder).glob(STEP_DIR.format(step="*")):
        if (n := step_number(later)) is not None and n > step:
            aside, k = later.with_name(f"{later.name}.rolled-back"), 1
            while aside.exists():  # an earlier rollback's
                k += 1
                aside = later.with_name(f"{later.name}.rolled-back-{k}")
            later.rename(aside)


def record(run: Path, rollback: dict) -> None:
    with open(rollbacks_file(run), "a") as f:
        f.write(json.dumps(rollback) + "\n")


def read_rollbacks(run: Path) -> list[dict]:
    """The rollbacks of a run dir, oldest first (a line cut by a kill is left out)."""
    return read_jsonl(rollbacks_file(run))
