"""Skip an optimizer step whose loss or gradient norm is non-finite or spiking, deciding on the device.

A step is skipped (the weights, AdamW moments and step count untouched) when
the global loss or the pre-clip gradient norm is NaN/inf, or, once ``window``
steps have been seen, exceeds the mean of the last ``window`` steps by more
than ``sigmas`` standard deviations. Every finite value joins the window,
skipped or not, so a lasting shift in level is accepted after a while instead
of skipping forever (OLMo-core's rule). Every rank sees the same global values,
so every rank decides alike.

The decision never leaves the device: ``check`` returns a 0/1 tensor that the
fused AdamW takes as its ``found_inf`` (the same switch AMP's GradScaler uses),
and the history and counters are device tensors. Reading them (``read``) costs
a host sync, so the trainer does it only at logging steps (OLMo-core's
``SkipStepOptimizer`` keeps its history on the device for the same reason).
The history is checkpointed, so a resumed run decides exactly as the
uninterrupted one would.

With ``remember`` > 0 the guard also keeps the steps of the latest ``remember``
skips (on the device, read with the counters), which is what a spike rollback
(``health.rollback``) needs to see that ``[training] spike_rollbacks`` spikes
came within a window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

REASONS = ("non-finite loss", "non-finite grad norm", "loss spike", "grad norm spike")


@dataclass(frozen=True)
class GuardReading:
    """The guard's counters, read on the host; ``last_*`` describe the latest skipped step."""

    skipped: int
    consecutive: int
    last_step: int
    last_reason: str | None
    recent: tuple[int, ...] = ()  # the steps of the latest ``remember`` skips, oldest first


class StepGuard:
    def __init__(self, sigmas: float, window: int, enabled: bool = True, device: torch.device | str = "cpu",
                 remember: int = 0):
        self.sigmas, self.window, self.enabled = sigmas, window, enabled
        z: dict[str, Any] = dict(device=device)
        self.recent = torch.zeros(remember, dtype=torch.int64, **z)  # steps of the latest skips, 0: none
        self.history = torch.zeros(window, 2, dtype=torch.float64, **z)  # (loss, grad norm), newest last
        self.filled = torch.zeros((), dtype=torch.int64, **z)
        self.skipped = torch.zeros((), dtype=torch.int64, **z)
        self.consecutive = torch.zeros((), dtype=torch.int64, **z)
        self.steps = torch.zeros((), dtype=torch.int64, **z)  # checks so far: the trainer's step
        # The latest skipped step: (step, reason index + 1, value, window mean, window std).
        self.last_skip = torch.zeros(5, dtype=torch.float64, **z)

    @torch.no_grad()
    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 if this step must be skipped, else 0.0: a float32 scalar on the guard's device."""
        x = torch.stack([loss.detach().reshape(()), grad_norm.detach().reshape(())]).to(self.history)
        finite = x.isfinite()
        std, mean = torch.std_mean(self.history, dim=0)
        bound = mean + self.sigmas * torch.maximum(std, 1e-6 * mean.abs())
        spike = (x > bound) & (self.filled >= self.window)
        reasons = torch.cat([~finite, spike])  # in the order of REASONS
        if not self.enabled:
            reasons = torch.zeros_like(reasons)
        skip = reasons.any()
        self.steps += 1
        code = reasons.to(torch.uint8).argmax() + 1  # the first reason that holds
        loss_side = code % 2 == 1  # reasons 1 and 3 are about the loss
        record = torch.stack([self.steps.to(x.dtype), code.to(x.dtype),
                              *(torch.where(loss_side, t[0], t[1]) for t in (x, mean, std))])
        self.last_skip.copy_(torch.where(skip, record, self.last_skip))
        both = finite.all()
        self.history.copy_(torch.where(both, torch.cat([self.history[1:], x[None]]), self.history))
        self.filled.add_(both.long()).clamp_(max=self.window)
        s = skip.long()
        if len(self.recent):
            self.recent.copy_(torch.where(skip, torch.cat([self.recent[1:], self.steps[None]]), self.recent))
        self.skipped += s
        self.consecutive.mul_(s).add_(s)  # +1 on a skip, back to 0 on an update
        return skip.float()

    def read(self) -> GuardReading:
        """The counters on the host: one device-to-host copy; call it at logging steps only."""
        skipped, consecutive, step, code, value, mean, std, *recent = torch.cat(
            [torch.stack([self.skipped, self.consecutive]).to(self.last_skip), self.last_skip,
             self.recent.to(self.last_skip)]).tolist()
        reason = None
        if code:
            name = REASONS[int(code) - 1]
            reason = (f"{name} ({value})" if name.startswith("non-finite") else
                      f"{name} ({value:.4g} > mean {mean:.4g} + {self.sigmas} sigma {std:.3g})")
        return GuardReading(int(skipped), int(consecutive), int(step), reason, tuple(int(s) for s in recent if s))

    def state_dict(self) -> dict:
        # One JSON string: DCP stores it as an opaque object, whatever the window's fill.
        # Floats round-trip exactly through JSON, so a resumed run decides alike.
        n = int(self.filled)
        history = self.history[self.window - n:].tolist() if n else []
        state = {"history": json.dumps(history), "skipped": int(self.skipped), "consecutive": int(self.consecutive)}
        return {**state, "recent": json.dumps(self.recent.tolist())} if len(self.recent) else state

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the guard as it was after ``step`` (the trainer's restored step)."""
        rows = json.loads(state["history"])[-self.window:]
        self.history.zero_()
        if rows:
            self.history[self.window - len(rows):] = torch.tensor(rows, dtype=self.history.dtype)
        self.filled.fill_(len(rows))
        self.skipped.fill_(int(state["skipped"]))
        self.consecutive.fill_(int(state.get("consecutive", 0)))
        recent = [s for s in json.loads(state.get("recent", "[]")) if s][-len(self.recent):] if len(self.recent) else []
        self.recent.zero_()
        if recent:
            self.recent[len(self.recent) - len(recent):] = torch.tensor(recent, dtype=self.recent.dtype)
        self.steps.fill_(step)

