"""The phases a rank goes through, declared once: what each may take and where its time goes.

A rank's heartbeat (``health.heartbeat``) names the phase it is in. Two readers act on it:

- the stall watchdog (``launch.watchdog``) allows a phase its ``allowance``: ``checkpoint`` and
  ``eval`` phases get the recipe's longer ``[launch] stall_timeout_checkpoint``/``_eval``, every
  other phase the steady ``stall_timeout``;
- goodput (``health.goodput``) books a phase's time in its ``bucket``: productive training,
  or one of the costs it reports.

The trainer enters its own phases (``LOAD``, ``FORWARD_BACKWARD``, ``OPTIMIZER``, ``CHECKPOINT``);
a callback declares its phase as a class attribute (``train.callbacks.callback.Callback.phase``),
entered while it runs (the heartbeat callback's ``DATA`` begins a step), so renaming a class moves
nothing. Torch-free: the watchdog imports it.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    BUILD = "build"  # model, data index, optimizer (before the first step)
    LOAD = "load"  # the checkpoint load before the first step
    DATA = "data"  # a step begins: its batches
    FORWARD_BACKWARD = "forward_backward"
    OPTIMIZER = "optimizer"  # clipping, the spike guard's decision, the update
    METRICS = "metrics"  # a logging step's numbers: progress, tokens per source
    REPLICA_CHECK = "replica_check"  # HSDP copies compared (health.consistency)
    STRAGGLER = "straggler"  # the compute check at logging steps (health.straggler)
    CHECKPOINT = "checkpoint"  # a save, and waiting for an async one
    ROLLBACK = "rollback"  # a spike rollback's checkpoint load (health.rollback)
    EVAL = "eval"
    EXPORT = "export"  # the end-of-run Hugging Face export
    REPORT = "report"  # rank 0 drawing the run report
    PREEMPTION = "preemption"  # the per-step agreement on a preemption request (its save is a CHECKPOINT)

    @property
    def allowance(self) -> str:
        """Which ``[launch] stall_timeout*`` the watchdog allows: ``steady``, ``checkpoint`` or ``eval``."""
        return _ALLOWANCE.get(self, "steady")

    @property
    def bucket(self) -> str:
        """Where goodput books this phase's time: ``productive`` or a cost (health.goodput.COSTS)."""
        return _BUCKET.get(self, "productive")

    @property
    def in_step(self) -> bool:
        """A rank in this phase has not finished its heartbeat's step yet."""
        return self in (Phase.DATA, Phase.FORWARD_BACKWARD, Phase.OPTIMIZER)

    @classmethod
    def of(cls, name: str) -> Phase | None:
        """The phase a heartbeat names; None for a name this code does not know (an older run's)."""
        try:
            return cls(name)
        except ValueError:
            return None


_ALLOWANCE = {Phase.CHECKPOINT: "checkpoint", Phase.ROLLBACK: "checkpoint",
              Phase.EVAL: "eval", Phase.EXPORT: "eval", Phase.REPORT: "eval"}
_BUCKET = {Phase.BUILD: "startup", Phase.LOAD: "startup", Phase.CHECKPOINT: "checkpoints",
           Phase.ROLLBACK: "rollbacks", Phase.EVAL: "evals", Phase.EXPORT: "evals", Phase.REPORT: "evals",
           Phase.PREEMPTION: "preemptions"}


def allowance(name: str) -> str:
    """The allowance of a phase named in a heartbeat; an unknown name is steady."""
    phase = Phase.of(name)
    return phase.allowance if phase else "steady"


def bucket(name: str) -> str:
    """The goodput bucket of a phase named in a heartbeat; an unknown name is productive."""
    phase = Phase.of(name)
    return phase.bucket if phase else "productive"
