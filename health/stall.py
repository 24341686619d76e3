"""How long a launch may be silent: the one rule by which ``launch.watchdog`` ends a stall and
``health.holder`` tells a live holder on another host from a stale one.

The newest beat of any rank counts, against the allowance of the most lenient phase a rank is in
(``health.phases.Phase.allowance``): in synchronous training one stuck rank soon stops the
others in their next collective, and a rank legitimately alone in a long phase (rank 0 drawing the
report) holds the others at the next step. Until every rank has finished its first step of the
launch, the first-step allowance (rendezvous, imports, build, checkpoint load, compile). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from health.phases import allowance as phase_allowance


@dataclass
class Limits:
    """Seconds of silence allowed (``[launch]`` stall_timeout*); ``stall`` 0: never a stall."""
    stall: float
    first_step: float
    checkpoint: float
    eval: float

    @classmethod
    def of(cls, launch) -> Limits:
        return cls(launch.stall_timeout, launch.stall_timeout_first_step, launch.stall_timeout_checkpoint,
                   launch.stall_timeout_eval)


def allowance(beats: list[dict], limits: Limits) -> tuple[float, str]:
    """(seconds, why) of silence allowed now, given every rank's latest beat."""
    world = max((b.get("world", 1) for b in beats), default=1)
    if len(beats) < world or any(b.get("done", 0) == 0 for b in beats):
        return limits.first_step, "first step"
    allowed = [(limits.stall, "steady")]
    for b in beats:
        if (kind := phase_allowance(b.get("phase", ""))) != "steady":
            allowed.append((getattr(limits, kind), b["phase"]))
    return max(allowed)
