"""What the launcher tests share: waiting on a run's progress."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait_for(predicate, what: str, timeout: float = 120, detail=None):
    """``predicate()``'s first truthy value, polled every 0.2 s for ``timeout`` seconds. Wait for events
    a run writes (a line in attempts.jsonl, a complete checkpoint), not for a state that can pass between
    two polls. ``detail()``: what to show on a timeout (e.g. the run's attempts)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} ({timeout:g} s)" + (f": {detail()}" if detail else ""))


def logged_steps(run: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except FileNotFoundError:
        return 0
