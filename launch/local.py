"""The SLURM flow on one machine: torchrun, restarts after crashes and preemption.

    python -m launch.local --recipe tiny.toml --nproc 2 [--set table.key=value]

Each start is recorded in the run dir and ends as launch.attempts decides:
finished; restarted from the latest checkpoint (a preemption, or a crash that
left a newer checkpoint, within the recipe's ``[launch] crashes_per_day``); or
given up on.
SIGUSR1 sent to this process checkpoints the run and restarts it, as a SLURM
requeue would. A start that makes no progress for the recipe's ``[launch]
stall_timeout`` is ended as stalled (launch.watchdog: stacks in
``<run>/stalls/``) and restarted like a crash. A run dir whose ranks of another
launch are alive is refused before anything is written (exit 2,
``health.holder``); a stale one is taken over.

The terminal shows rank 0; every rank's output goes to
``<run>/launcher/logs/local/`` (torchrun's ``--tee``, one folder per start).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from launch.attempts import begin, end, logs_dir
from launch.sbatch import SIGNALS_TO_HANDLE
from launch.watchdog import Limits, Watchdog, attempt_name
from rundir import LOCAL_LOGS_DIR, REPO, exit_file
from train import recipe as R
from health.exits import EXIT_FILE_ENV, Exit
from health.heartbeat import LAUNCH_ENV
from health.holder import claim
from health.storage import NoSpace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tiny.toml", help="recipe file, or a name in recipes/")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from train.build import preflight

    try:
        recipe = R.load(args.recipe, args.set)
        problems = preflight(recipe, args.nproc).problems  # train.py's own checks, before anything is written
        if problems:
            raise R.RecipeError("\n".join(problems))
    except R.RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    run, job = recipe.output_dir, f"local-{os.getpid()}"
    if held := claim(run, recipe.launch, job=job, say=lambda line: print(f"launch.local: {line}", file=sys.stderr)):
        print(f"error: {held}", file=sys.stderr)  # before begin(), which clears the holder's heartbeats
        return Exit.BAD_INPUT
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.nproc}",
           f"--signals-to-handle={SIGNALS_TO_HANDLE}", f"--log-dir={logs_dir(run) / LOCAL_LOGS_DIR}", "--tee=3",
           "--local-ranks-filter=0", str(REPO / "train.py"), "--recipe", args.recipe,
           *(f"--set={s}" for s in args.set)]
    env = {**os.environ, EXIT_FILE_ENV: str(exit_file(run)), LAUNCH_ENV: job}  # the ranks hold this launch's claim
    proc = None
    signal.signal(signal.SIGUSR1, lambda sig, frame: proc and proc.send_signal(sig))
    while True:
        try:
            start = begin(run, job)
            print(f"launch.local: starting from step {start['step']}", file=sys.stderr, flush=True)
            proc = subprocess.Popen(cmd, cwd=REPO, env=env)
            rc = watch(proc, Watchdog(run, Limits.of(recipe.launch), attempt_name(run)))
            event = end(run, job, rc, recipe.launch.crashes_per_day)
        except NoSpace as e:
            print(f"launch.local: error: {e}", file=sys.stderr)
            return e.code
        print(f"launch.local: {event['why']}", file=sys.stderr, flush=True)
        if event["action"] != "restart":
            return 0 if event["action"] == "done" else 1


def watch(proc: subprocess.Popen, dog: Watchdog) -> int:
    """torchrun's exit status; on a stall, its ranks' stacks are dumped and the whole tree killed."""
    while True:
        try:
            return proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        if stall := dog.check():
            where = dog.handle(stall)
            print(f"launch.local: STALL: no progress for {stall['idle_s']:.1f} s; stacks in {where}",
                  file=sys.stderr, flush=True)
            kill_tree(proc.pid)
            return proc.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (torchrun's ranks run in their own sessions; a
    stopped rank ends only by SIGKILL)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main())
