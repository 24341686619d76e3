"""Skip an optimizer step whose loss or gradient norm is non-finite or spiking.

A step is skipped (its gradients dropped, the weights untouched) when the
global loss or the pre-clip gradient norm is NaN/inf, or, once ``window``
steps have been seen, exceeds the mean of the last ``window`` steps by more
than ``sigmas`` standard deviations. Every finite value joins the window,
skipped or not, so a lasting shift in level is accepted after a while instead
of skipping forever (OLMo-core's rule). Every rank sees the same global values, so every rank decides
alike. The history is checkpointed, so a resumed run decides exactly as the
uninterrupted one would.
"""

from __future__ import annotations

import json
import math
from collections import deque


class StepGuard:
    def __init__(self, sigmas: float, window: int, enabled: bool = True):
        self.sigmas, self.window, self.enabled = sigmas, window, enabled
        self.history: deque[tuple[float, float]] = deque(maxlen=window)
        self.skipped = 0
        self.last_reason: str | None = None

    def check(self, loss: float, grad_norm: float) -> str | None:
        """Why this step must be skipped, or None."""
        reason = self._reason(loss, grad_norm) if self.enabled else None
        self.last_reason = reason
        self.skipped += reason is not None
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.history.append((loss, grad_norm))
        return reason

    def _reason(self, loss: float, grad_norm: float) -> str | None:
        for name, value in (("loss", loss), ("grad norm", grad_norm)):
            if not math.isfinite(value):
                return f"non-finite {name} ({value})"
        if len(self.history) < self.window:
            return None
        for i, (name, value) in enumerate((("loss", loss), ("grad norm", grad_norm))):
            past = [h[i] for h in self.history]
            mean = sum(past) / len(past)
            std = math.sqrt(sum((p - mean) ** 2 for p in past) / (len(past) - 1))
            if value > mean + self.sigmas * max(std, 1e-6 * abs(mean)):
                return f"{name} spike ({value:.4g} > mean {mean:.4g} + {self.sigmas} sigma {std:.3g})"
        return None

    def state_dict(self) -> dict:
        # One JSON string: DCP stores it as an opaque object, whatever the window's fill.
        return {"history": json.dumps(list(self.history)), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((tuple(h) for h in json.loads(state["history"])), maxlen=self.window)
        self.skipped = int(state["skipped"])
