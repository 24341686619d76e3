"""``python -m report RUN [RUN ...] [--out DIR] [--plan-gpu KIND --gpus N]``, or
``python -m report SWEEP_DIR [--out DIR]`` for a sweep (launch.sweep's ``sweep.json``:
comparison.csv, summary.csv and the page, report/sweep.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rundir import SWEEP_FILE
from report import ReportError, write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m report", description=__doc__)
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run dirs (several are overlaid), or one sweep dir")
    p.add_argument("--out", type=Path, help="where report.html and its PNGs go (default: RUN/report/, or the sweep dir)")
    p.add_argument("--plan-gpu", metavar="KIND", help="first trace the memory plan of each run's recipe on --gpus "
                   "GPUs of this kind (h100, h200, a100, mi300x) into RUN/plan.json; the memory figure draws it")
    p.add_argument("--gpus", type=int, default=8, help="with --plan-gpu: the number of GPUs (default 8)")
    args = p.parse_args(argv)
    try:
        if len(args.runs) == 1 and (args.runs[0] / SWEEP_FILE).is_file():
            from report.sweep import write_sweep_report  # with scipy (0.6 s): a run's report needs neither

            path, lines = write_sweep_report(args.runs[0], args.out)
            print("\n".join(lines))
            print(path)
            return 0
        if args.plan_gpu:
            from report.memory import record_plan

            for run in args.runs:
                record_plan(run, args.plan_gpu, args.gpus)
        path = write_report(args.runs, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
