"""The names of logged metrics that other programs read, named once and torch-free.

The callbacks that log them import them from here, and so do their readers: the run report and
the sweep comparison (``python -m report``, which needs no torch), the planner's data lines
and ``train.py``'s end-of-run summary. A preference run's own are in ``train.preference.metrics``.
"""

VAL_LOSS = "eval/val_loss"  # nats per token over every held-out set (the token-weighted mean of the sets')
VAL_BPB = "eval/val_bpb"  # bits per byte over every held-out set
LAUNCH = "launch"  # logged at a process's first step: the launch number (report.runs marks restarts)
PARAMETERS = "parameters"  # ... and the model's parameter count


def per_set(metric: str, name: str) -> str:
    """One held-out set's metric: ``eval/val_loss/<name>`` (a source's name, or a val_sources folder's)."""
    return f"{metric}/{name}"
