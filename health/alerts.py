"""``alerts.jsonl``: what the ranks flag for people (a straggler, a replica mismatch), one writer.

Each line has the same fields: ``time``, ``kind``, ``step``, ``text`` (what a person reads) and
the kind's own details. ``launch.slurm status`` and the run report read it. Torch-free.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from rundir import alerts_file, read_jsonl


def write_alert(run: Path, kind: str, step: int, text: str, **details) -> dict:
    """Append one alert (rank 0 calls it); returns the record."""
    record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "kind": kind, "step": step,
              **details, "text": text}
    with open(alerts_file(run), "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def read_alerts(run: Path) -> list[dict]:
    """The run's alerts, oldest first (a line rank 0 is still appending is left out)."""
    return read_jsonl(alerts_file(run))
