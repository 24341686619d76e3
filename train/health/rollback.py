"""Spike rollback: spikes that keep coming back are rolled back, and the data around them skipped.

The step guard (``train.health.guard``) skips a spiking step, and 100 skips in a row stop the run
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

Each rollback is a line of ``<run>/rollbacks.jsonl`` (the steps, the skipped global samples and
their tokens per source), which the run report marks. Without a checkpoint before the spikes
nothing is rolled back: the guard goes on skipping.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from rundir import is_complete, read_jsonl, step_number

if TYPE_CHECKING:
    from train.trainer import LaneformerTrainer

ROLLBACKS_FILE = "rollbacks.jsonl"  # in the run dir


def due(recent: tuple[int, ...], spikes: int, window: int) -> bool:
    """Whether the latest ``spikes`` skipped steps (``recent``, oldest first) came within ``window`` steps."""
    return spikes > 0 and len(recent) >= spikes and recent[-1] - recent[-spikes] < window


def checkpoint_before(folder: Path, step: int) -> int | None:
    """The latest complete checkpoint's step before ``step``, if any."""
    steps = [n for p in Path(folder).glob("step-*") if (n := step_number(p)) is not None and n < step and is_complete(p)]
    return max(steps, default=None)


def roll_back(trainer: LaneformerTrainer, spikes: tuple[int, ...]) -> dict | None:
    """Roll the run back to the checkpoint before ``spikes`` (skipped steps), skipping the data since;
    every rank calls it at the same step (the guard decides alike on every rank). Returns the record."""
    import torch.distributed as dist

    from torchtitan.tools.logging import logger

    run, folder = Path(trainer.config.dump_folder), Path(trainer.checkpointer.folder)
    at, loader = trainer.step, trainer.dataloader
    to = checkpoint_before(folder, spikes[0])
    if to is None:
        logger.warning(f"step {at}: {len(spikes)} spikes within {trainer.config.spike_window} steps (at steps "
                       f"{', '.join(map(str, spikes))}) but no complete checkpoint before step {spikes[0]} in "
                       f"{folder}: not rolled back, the spiking steps stay skipped")
        return None
    reached = loader.loader.next_index
    trainer.checkpointer.maybe_wait_for_saving()
    trainer.checkpointer.load(step=to)
    first, last = loader.skip_to(reached)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        for later in folder.glob("step-*"):
            if (n := step_number(later)) is not None and n > to:
                aside, k = later.with_name(f"{later.name}.rolled-back"), 1
                while aside.exists():  # an earlier rollback's
                    k += 1
                    aside = later.with_name(f"{later.name}.rolled-back-{k}")
                later.rename(aside)
    mixture = loader.mixture
    skipped = {name: mixture.consumed_tokens(last)[name] - n for name, n in mixture.consumed_tokens(first).items()}
    record = {"time": datetime.now(timezone.utc).isoformat(), "at_step": at, "to_step": to, "spikes": list(spikes),
              "checkpoint": str(folder / f"step-{to}"), "skipped_samples": [first, last],
              "skipped_tokens": skipped}
    if rank0:
        with open(run / ROLLBACKS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
    if dist.is_initialized():
        dist.barrier()
    logger.warning(f"ROLLBACK at step {at}: {len(spikes)} spikes within {trainer.config.spike_window} steps (at "
                   f"steps {', '.join(map(str, spikes))}); back to the checkpoint of step {to}, skipping global "
                   f"samples {first:,} to {last - 1:,} ({sum(skipped.values()):,} tokens: "
                   + ", ".join(f"{k} {v:,}" for k, v in skipped.items()) + f"); recorded in {run / ROLLBACKS_FILE}")
    return record


def read_rollbacks(run: Path) -> list[dict]:
    """The rollbacks of a run dir, oldest first (a line cut by a kill is left out)."""
    return read_jsonl(Path(run) / ROLLBACKS_FILE)
