"""What the launcher tests share: waiting on a run's progress."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait_for(predicate, what: str, timeout: float = 120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except FileNotFoundError:
        return 0
