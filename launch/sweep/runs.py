"""A sweep's runs: each variant x seed's run dir, its state from the launchers' own records, the
sweep dir's ``sweep.json``, and starting the runs through ``launch.local`` or ``launch.slurm submit``
(their requeue, resume and crash rules apply unchanged: a sweep only starts them)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launch.attempts import history, job_info
from launch.sweep.spec import Sweep, Variant, set_args
from rundir import LOGS_DIR, REPO, RUNS_DIR, SWEEP_FILE, SWEEPS_DIR

STATES = ("done", "running", "failed", "left")


def sweep_dir(name: str) -> Path:
    """Where a sweep's runs go without ``--root``."""
    return REPO / RUNS_DIR / SWEEPS_DIR / name


@dataclass
class RunSpec:
    variant: Variant
    seed: int
    dir: Path

    @property
    def label(self) -> str:
        return self.dir.name

    def sets(self, sweep: Sweep) -> list[str]:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{sweep.name}-{self.label}")
        return set_args({**sweep.sets, **self.variant.declared, "run.output_dir": str(self.dir),
                         "run.seed": self.seed, "run.name": name})


def runs_of(found: list[Variant], sweep: Sweep, root: Path) -> list[RunSpec]:
    """Seed by seed, so a sweep cut short has every variant at its first seeds."""
    return [RunSpec(v, seed, root / f"{v.name}-seed{seed}") for seed in sweep.seeds for v in found]


# ---- states ------------------------------------------------------------------------------------


def _alive(job: str) -> bool:
    """Whether the launcher that recorded ``job`` still runs: launch.local's process
    (``local-<pid>``), or a SLURM job the controller has queued or running."""
    if job.startswith("local-"):
        try:
            cmdline = Path(f"/proc/{int(job.removeprefix('local-'))}/cmdline").read_bytes()
        except (OSError, ValueError):
            return False
        return b"launch.local" in cmdline
    from launch.slurm import ACTIVE

    return job_info(job).get("JobState") in ACTIVE


def state(run: Path) -> str:
    """done, running (its launcher is alive: a local process, a queued or running job), failed
    (the launcher gave up; a rerun tries again) or left (not started, or its launcher stopped:
    a rerun resumes it), from the launchers' own records (launch/attempts.py, launch.slurm's job ids)."""
    from launch.slurm import job_ids

    events, jobs = history(run), job_ids(run)
    last = events[-1] if events else None
    if last and last["event"] == "end" and last["action"] == "done":
        return "done"
    job = jobs[-1] if jobs else (last["job"] if last else None)
    if job and _alive(job):
        return "running"
    return "failed" if last and last["event"] == "end" and last["action"] == "fail" else "left"


def write_record(root: Path, sweep: Sweep, found: list[Variant], runs: list[RunSpec], states: dict[Path, str],
                 launcher: str) -> None:
    """``sweep.json``: the grid, each run's dir (relative to the sweep dir) and state."""
    record = {
        "name": sweep.name, "file": str(sweep.path.resolve()), "recipe": sweep.recipe, "set": sweep.sets,
        "vary": sweep.grids, "seeds": sweep.seeds, "baseline": found[0].name, "metric": sweep.metric,
        "launcher": launcher,
        "variants": [{"name": v.name, "values": v.values, "set": v.declared} for v in found],
        "runs": [{"variant": r.variant.name, "seed": r.seed, "run_dir": r.dir.name, "state": states[r.dir]}
                 for r in runs],
    }
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(root / SWEEP_FILE)


def tally(states: dict[Path, str]) -> str:
    counts = {s: sum(1 for x in states.values() if x == s) for s in STATES}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n or s != "failed")


# ---- launching ---------------------------------------------------------------------------------


def local_command(sweep: Sweep, run: RunSpec, nproc: int) -> list[str]:
    return [sys.executable, "-m", "launch.local", "--recipe", sweep.recipe, "--nproc", str(nproc),
            *(f"--set={s}" for s in run.sets(sweep))]


def slurm_command(sweep: Sweep, run: RunSpec, args) -> list[str]:
    opts = [f"--{k.replace('_', '-')}={v}" for k in ("partition", "account", "time", "nodes", "gpus_per_node",
                                                      "nproc_per_node") if (v := getattr(args, k)) is not None]
    return [sys.executable, "-m", "launch.slurm", "submit", "--recipe", sweep.recipe, *opts, *args.slurm_arg,
            *(f"--set={s}" for s in run.sets(sweep))]


def launch_local(todo: list[RunSpec], sweep: Sweep, args, root: Path, on_change) -> int:
    """launch.local per run, ``--parallel`` at once; each run's output in ``logs/<run>.log``. Returns how
    many launch.local exited non-zero (its launcher gave up on the run)."""
    logs = root / LOGS_DIR
    logs.mkdir(exist_ok=True)
    pending, active, failed = list(todo), {}, 0
    while pending or active:
        while pending and len(active) < args.parallel:
            run = pending.pop(0)
            log = open(logs / f"{run.label}.log", "a")
            print(f"sweep: start {run.label} (log {log.name})", flush=True)
            active[subprocess.Popen(local_command(sweep, run, args.nproc), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)] = (run, log)
            on_change()
        time.sleep(0.5)
        for proc in [p for p in active if p.poll() is not None]:
            run, log = active.pop(proc)
            log.close()
            failed += proc.returncode != 0
            print(f"sweep: {run.label}: {state(run.dir)} (launch.local exit {proc.returncode})", flush=True)
            on_change()
    return failed


def launch_slurm(todo: list[RunSpec], sweep: Sweep, args, on_change) -> int:
    """launch.slurm submit per run (it checks, snapshots and queues; the job requeues itself). Returns how
    many submissions failed."""
    failed = 0
    for run in todo:
        out = subprocess.run(slurm_command(sweep, run, args), cwd=REPO, capture_output=True, text=True)
        said = (out.stdout.strip() if out.returncode == 0 else out.stderr.strip()) or f"exit {out.returncode}"
        print(f"sweep: {run.label}: {said}", flush=True)
        failed += out.returncode != 0
        on_change()
    return failed
