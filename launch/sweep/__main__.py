"""``python -m launch.sweep SWEEP.toml ...``: check every variant, print the grid and the runs' states,
then start the runs that are neither done nor running (or, ``--dry-run``, only print; see ``launch.sweep``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import launch.sweep
from launch.sweep.runs import launch_local, launch_slurm, runs_of, state, sweep_dir, tally, write_record
from launch.sweep.spec import SweepError, read_sweep, variants
from launch.sweep.table import grid_lines, plan_lines
from train import recipe as R
from health.exits import Exit
from plan.gpus import GPUS

TO_START = ("failed", "left")  # what a launch starts: a failed run is tried again, a left one resumed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.sweep", description=launch.sweep.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path, help="the sweep file (recipes/sweeps/*.toml)")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="an override for every run, after the file's [set]")
    p.add_argument("--root", type=Path, help="the sweep dir (default runs/sweeps/<name> in the repo)")
    p.add_argument("--dry-run", action="store_true", help="print the grid (and with --gpus the plan); start nothing")
    p.add_argument("--gpus", type=int, help="dry run: plan each run on this many GPUs")
    p.add_argument("--gpu", default="h100", choices=list(GPUS), help="dry run: the GPU kind")
    p.add_argument("--nproc", type=int, default=1, help="local: ranks per run (launch.local --nproc)")
    p.add_argument("--parallel", type=int, default=1, help="local: runs at once")
    p.add_argument("--slurm", action="store_true", help="submit each run with launch.slurm (a job per run)")
    for name in ("partition", "account", "time"):
        p.add_argument(f"--{name}", help="slurm: passed to launch.slurm submit")
    p.add_argument("--nodes", type=int, help="slurm: nodes per run")
    p.add_argument("--gpus-per-node", type=int, help="slurm: GPUs per node (0: none)")
    p.add_argument("--nproc-per-node", type=int, help="slurm: ranks per node")
    p.add_argument("--slurm-arg", action="append", default=[], metavar="ARG",
                   help="slurm: any other launch.slurm submit option, e.g. --slurm-arg=--no-exclusive")
    return p.parse_args(argv)


def world_size(args) -> int:
    if args.dry_run and args.gpus:
        return args.gpus
    if args.slurm:
        return (args.nodes or 1) * (args.nproc_per_node or (8 if args.gpus_per_node is None else args.gpus_per_node))
    return args.nproc


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.parallel < 1 or args.nproc < 1:
        print("error: --parallel and --nproc must be >= 1", file=sys.stderr)
        return Exit.BAD_INPUT
    try:
        sweep = read_sweep(args.sweep, args.set)
        root = (args.root or sweep_dir(sweep.name)).resolve()
        found, problems = variants(sweep, world_size(args), root)
    except (SweepError, R.RecipeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    if problems and not args.dry_run or not found:  # before anything is written
        print(f"error: {problems}\nnothing was started or written", file=sys.stderr)
        return Exit.BAD_INPUT
    runs = runs_of(found, sweep, root)
    states = {r.dir: state(r.dir) for r in runs}
    print(f"sweep {sweep.name}: {sweep.recipe}, {len(found)} variants x {len(sweep.seeds)} seeds = {len(runs)} runs "
          f"in {root}; baseline {found[0].name}")
    print("\n".join(grid_lines(sweep, found)))
    print("runs: " + tally(states))
    if args.dry_run:
        print("\n".join(f"  {r.label}: {states[r.dir]}" for r in runs))
        if args.gpus:
            print("\n".join(plan_lines(found, sweep, args.gpus, args.gpu)))
        if problems:  # as train.py --dry-run: the plan, then the verdict a launch would give
            print(f"error: {problems}", file=sys.stderr)
            return Exit.BAD_INPUT
        print(f"checks: every variant passed; a launch would start {sum(s in TO_START for s in states.values())} runs")
        return Exit.DONE
    launcher = "slurm" if args.slurm else "local"

    def on_change():
        states.update({r.dir: state(r.dir) for r in runs})
        write_record(root, sweep, found, runs, states, launcher)

    todo = [r for r in runs if states[r.dir] in TO_START]
    on_change()
    print(f"starting {len(todo)}: {', '.join(r.label for r in todo) or 'nothing'}", flush=True)
    failed = launch_slurm(todo, sweep, args, on_change) if args.slurm else launch_local(todo, sweep, args, root,
                                                                                         on_change)
    on_change()
    print("runs: " + tally(states))
    if all(s == "done" for s in states.values()):
        print(f"compare: python -m report {root}")
    return Exit.CRASH if failed else Exit.DONE  # a run's launcher gave up: see launch.sweep's docstring


if __name__ == "__main__":
    sys.exit(main())
