"""A run at a glance: ``report.html`` and its PNGs, written from a run dir by the run itself
(``train.callbacks.report``) or by hand::

    python -m report RUN [RUN ...] [--out DIR] [--plan-gpu h100 --gpus N]

Several runs share the axes: their curves are overlaid, and a run that started
from another listed run's checkpoint (phase 2 from phase 1) continues it along
the token axis. Without ``--out`` the report goes to ``RUN/report/`` (the first
run's). Modules: ``runs`` reads a run dir, ``figures`` draws, ``phases`` compares
a phase's short-context numbers with the run it started from, ``page`` writes
the HTML, ``memory`` draws and records the memory plan; ``sweep`` compares a sweep's runs,
``forgetting`` (``python -m report.forgetting SWEEP_DIR``) draws a phase-2 sweep's general against
its phase-2 held-out loss beside phase 1 and merges of the two.
"""

from __future__ import annotations

from pathlib import Path

from rundir import REPORT_PAGE, report_dir
from report.runs import ReportError, continue_runs, header, read_run

__all__ = ["ReportError", "write_report"]


def write_report(runs: list[Path], out: Path | None = None) -> Path:
    """Read every run (ReportError names a file that cannot be read), then write the PNGs and
    ``report.html`` into ``out`` (default: the first run's ``report/``); returns the page's path."""
    from report.figures import all_figures
    from report.page import page
    from report.phases import comparisons

    read = [read_run(Path(r)) for r in runs]
    continue_runs(read)
    out = Path(out) if out is not None else report_dir(read[0].path)
    out.mkdir(parents=True, exist_ok=True)
    figures = all_figures(read, out)
    path = out / REPORT_PAGE
    tmp = path.with_name(f".{REPORT_PAGE}.tmp")
    tmp.write_text(page(read, [header(r) for r in read], figures, comparisons(read)))
    tmp.replace(path)  # a reader never sees half a page
    return path
