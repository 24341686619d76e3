"""The run writes its own report (``report``): after each in-loop eval and at the end.

Rank 0 runs ``python -m report RUN`` in a child process, so drawing never
holds up a step (the final one is waited for, so the end-of-run summary can
point at it); a refresh still running when the next is due is not doubled. A
report that fails is logged with its output (``report/refresh.log``) and training
goes on; a run that stops on an error draws it once more. At the first step of each process it also logs the launch number
(``launch``), so the report marks restarts of runs started without a launcher,
and the model's parameter count, so the report needs no torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


import rundir
from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from train.callbacks.callback import Callback, TrainerView
from health.holder import killed_with_parent
from health.phases import Phase
from train.metric_names import LAUNCH, PARAMETERS


class Report(Callback[TrainerView], Configurable):
    name = "report"
    priority = -10  # after the step's eval (and, at the end, the export) it draws
    phase = Phase.REPORT

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every: int = 0  # steps between in-loop evals ([eval] every); 0: only at the end
        final_timeout_s: float = 600.0  # the end-of-run refresh is waited for at most this long

    def __init__(self, config: Config, trainer: TrainerView):
        self.config = config
        self.child: subprocess.Popen | None = None
        self.logged_launch = False

    def post_step(self, trainer: TrainerView) -> None:
        run = Path(trainer.config.dump_folder)
        if not self.logged_launch:
            self.logged_launch = True
            launches = sum(1 for p in (run / rundir.LAUNCHES_DIR).glob("[0-9]*") if p.is_dir())
            parameters = sum(p.numel() for part in trainer.model_parts for p in part.parameters())  # DTensor: global
            trainer.metrics_processor.logger.log({LAUNCH: max(launches, 1), PARAMETERS: parameters},
                                                 trainer.step)
        c, step = self.config, trainer.step
        if c.every and step % c.every == 0 and step != trainer.config.training.steps and trainer.rank0:
            self._refresh(run, wait=False)

    def post_train(self, trainer: TrainerView) -> None:
        if trainer.rank0:
            self._refresh(Path(trainer.config.dump_folder), wait=True)

    def on_error(self, trainer: TrainerView, error: Exception) -> None:
        """A run stopped by an error (too many skipped steps, a replica mismatch, a crash) gets its report
        drawn once more: its last numbers are what a person looks at first."""
        if trainer.rank0:
            self._refresh(Path(trainer.config.dump_folder), wait=True)

    def _refresh(self, run: Path, wait: bool) -> None:
        try:
            if self.child is not None and self._done(self.child, run, wait) is None:
                return  # the previous refresh is still drawing
            out = rundir.report_dir(run)
            out.mkdir(parents=True, exist_ok=True)
            with open(out / rundir.REPORT_LOG, "w") as log:
                self.child = subprocess.Popen(
                    [sys.executable, "-m", "report", str(run)], stdout=log, stderr=subprocess.STDOUT,
                    cwd=rundir.REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                    preexec_fn=killed_with_parent)  # no second writer in the run dir once this rank is gone
            if wait:
                self._done(self.child, run, wait=True)
        except Exception as e:  # the report must never stop training
            logger.warning(f"report: not refreshed ({type(e).__name__}: {e})")

    def _done(self, child: subprocess.Popen, run: Path, wait: bool) -> int | None:
        """The exit status of ``child`` (drawing ``run``'s report) once it has ended (logging a failure), else None."""
        try:
            rc = child.wait(self.config.final_timeout_s) if wait else child.poll()
        except subprocess.TimeoutExpired:
            child.kill()
            rc = child.wait()
        if rc is None:
            return None
        self.child = None
        log = rundir.report_dir(run) / rundir.REPORT_LOG
        if rc != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            logger.warning(f"report: python -m report failed (exit {rc}); training goes on. {log}:\n{tail}")
        elif wait:
            logger.info(f"report: {rundir.report_dir(run) / rundir.REPORT_PAGE}")
        return rc

