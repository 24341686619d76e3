"""The names of logged metrics that other programs read, named once and torch-free.

The callbacks that log them import them from here, and so do their readers: the run report and
the sweep comparison (``python -m report``, which needs no torch), the planner's data lines
and ``train.py``'s end-of-run summary. A preference run's own are in ``train.preference.metrics``.
The loss by position is named in ``eval.position_loss`` (``python -m eval.run`` writes it too, and
eval sits below train) and read through here.
"""

from eval.position_loss import VAL_LOSS_POS as VAL_LOSS_POS
from eval.position_loss import bucket_of as bucket_of
from eval.position_loss import position_metric as position_metric

VAL_LOSS = "eval/val_loss"  # nats per token over every held-out set (the token-weighted mean of the sets')
VAL_BPB = "eval/val_bpb"  # bits per byte over every held-out set
LAUNCH = "launch"  # logged at a process's first step: the launch number (report.runs marks restarts)
PARAMETERS = "parameters"  # ... and the model's parameter count


def per_set(metric: str, name: str) -> str:
    """One held-out set's metric: ``eval/val_loss/<name>`` (a source's name, or a val_sources folder's)."""
    return f"{metric}/{name}"


def at_length(metric: str, length: int, seq_len: int) -> str:
    """A validation metric at ``length`` in a run trained at ``seq_len`` (``[eval] val_seq_lens``): the
    plain name at the run's own length, which every reader already compares, and ``eval/val_loss@4096``
    at another (per set: ``per_set(at_length(...), name)``, ``eval/val_loss@4096/<name>``). ``@``, not a
    ``/``: after ``eval/val_loss/`` comes a set's name, and a length must not read as one."""
    return metric if length == seq_len else f"{metric}@{length}"
