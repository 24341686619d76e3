"""Run a recipe on a SLURM cluster, preemptible and self-requeueing; inspect and stop it.

    python -m launch.slurm submit --recipe phase1.toml --nodes 24 --gpus-per-node 8 \\
        [--partition P] [--account A] [--time T] [--exclude NODES] [--dry-run] [...]
    python -m launch.slurm status RUN_DIR     # state, progress, goodput, slow hosts, why it failed
    python -m launch.slurm logs RUN_DIR [-n 40] [-f]
    python -m launch.slurm cancel RUN_DIR

``submit`` runs train.py's checks (the recipe against the world size, the
model, tokenizer, data, ``init_from``, writable dirs; ``--no-preflight`` keeps
only the model's) and, on GPUs, that one training step fits their memory
(``train.py --plan``; ``--no-plan`` skips it); any problem: exit 2, nothing
written or queued. ``--dry-run`` prints the batch script, with the plan (memory, communication
for the job's nodes) and the same verdict in it as comments: its output is a valid script.
Then it snapshots code and recipe
into the run dir (``launches/NNN``), freezes the resolved recipe the job will
train (``launcher/recipe.toml``: editing recipes/ later does not change a queued
or requeued job), writes ``launcher/job.sbatch`` (see launch/sbatch.py) and
submits it. Submitting the same recipe again resumes the run, e.g. with
``--exclude`` naming nodes that failed it. The job requeues itself after
preemption and after crashes that followed progress (within the recipe's
``[launch] crashes_per_day``); a crash pinned to a node requeues without that
node, and ``status`` shows the exclusion and why. ``status`` also works for a
run started with launch.local (its starts and ends), and shows the run's
goodput and what each cause cost (health.goodput) and the hosts named as
stragglers (health.straggler).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from launch.attempts import checkpoint_step, history, job_info
from health.goodput import lines as goodput_lines
from launch.sbatch import Job, render
from rundir import JOBS_FILE, RECIPE_FILE, SBATCH_FILE, launcher_dir, logs_dir, recorded_recipe
from health.alerts import read_alerts
from train import recipe as R

ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}


def job_ids(run: Path) -> list[str]:
    path = launcher_dir(run) / JOBS_FILE
    return path.read_text().split() if path.exists() else []


def check(recipe: R.Recipe, args, world_size: int):
    """(problems, model config): train.py's own checks before anything is written (the data,
    tokenizer, init_from, writable dirs; ``--no-preflight``: only the model, for a login node
    that cannot see the cluster's data, which the job then checks), then on GPUs the memory
    plan (``--no-plan`` skips it). Nothing is submitted or recorded when there are problems."""
    from train.build import preflight
    from train.recipe import model_config

    if args.no_preflight:
        try:
            problems, config = [], model_config(recipe)  # model overrides are checked against the model
        except R.RecipeError as e:
            return [str(e)], None
    else:
        checked = preflight(recipe, world_size)
        problems, config = checked.problems, checked.config
    if args.gpus_per_node and not args.no_plan and config is not None:  # memory per GPU, before the queue
        from plan import plan
        from plan.comm import cluster_for

        # communication as this job places its ranks: --nodes nodes of world_size / nodes each
        text, fits = plan(recipe, gpus=world_size, gpu=args.gpu,
                          cluster=cluster_for(args.gpu, gpus_per_node=world_size // args.nodes))
        if args.dry_run:  # stdout stays a valid batch script: the plan goes into it as comments
            text = "\n".join(f"# {line}" for line in text.splitlines())
        print(text, file=sys.stdout if fits else sys.stderr)
        if not fits:
            problems.append(f"{recipe.path}: does not fit {world_size} x {args.gpu} "
                            "(the plan above); --no-plan submits anyway")
    return problems, config


def verdict(args) -> str:
    """What the checks that ran found, and which were skipped (``--no-preflight``, ``--no-plan``)."""
    skipped = [*(["tokenizer, data, init_from and writable dirs (--no-preflight: the job checks them)"]
                 if args.no_preflight else []),
               *(["the memory plan (--no-plan)"] if args.gpus_per_node and args.no_plan else [])]
    if not skipped:
        return "all passed"
    return f"{'the model passed' if args.no_preflight else 'all others passed'}; skipped: {'; '.join(skipped)}"


def submit(args) -> int:
    nproc = args.nproc_per_node or args.gpus_per_node
    if args.nodes < 1 or nproc < 1:
        print("error: need --nodes >= 1 and ranks per node >= 1 (--nproc-per-node, or --gpus-per-node)",
              file=sys.stderr)
        return 2
    try:
        recipe = R.load(args.recipe, args.set)
        R.check_world(recipe, args.nodes * nproc)
        run = recipe.output_dir
        recipe.run.output_dir = str(run)  # the frozen recipe must not depend on the job's cwd
        script = render(Job(
            run_dir=run, recipe=launcher_dir(run) / RECIPE_FILE, name=recipe.run.name,
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, nproc_per_node=nproc,
            partition=args.partition, account=args.account, time=args.time, exclude=args.exclude,
            exclusive=not args.no_exclusive, signal_lead=args.signal_lead,
            crashes_per_day=recipe.launch.crashes_per_day, exclude_stragglers=recipe.launch.exclude_stragglers,
            rdzv_port=args.rdzv_port,
            nccl_socket_ifname=args.nccl_socket_ifname,
            nccl_ib_hca=args.nccl_ib_hca, env=args.env))
    except (R.RecipeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script, end="")
    problems, config = check(recipe, args, args.nodes * nproc)
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"# checks: {verdict(args)}; a submit would queue this job")
        return 0
    active = [j for j in job_ids(run) if job_info(j).get("JobState") in ACTIVE]
    if active:
        print(f"error: job {active[-1]} of {run} is still queued or running; "
              f"`python -m launch.slurm cancel {run}` first", file=sys.stderr)
        return 1

    from train.snapshot import record_launch

    launch = record_launch(recipe, config)
    logs_dir(run).mkdir(parents=True, exist_ok=True)
    (launcher_dir(run) / RECIPE_FILE).write_text(R.to_toml(recipe))
    batch = launcher_dir(run) / SBATCH_FILE
    batch.write_text(script)
    try:
        out = subprocess.run(["sbatch", "--parsable", str(batch)],
                             capture_output=True, text=True)
    except OSError as e:
        print(f"error: cannot run sbatch: {e}", file=sys.stderr)
        return 1
    if out.returncode != 0:
        print(f"error: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = out.stdout.strip().split(";")[0]
    with open(launcher_dir(run) / JOBS_FILE, "a") as f:
        f.write(job_id + "\n")
    print(f"submitted job {job_id}: run {run}, snapshot {launch}")
    return 0


def status(run: Path) -> str:
    """What the run is doing, how far it got, and why it stopped if it did."""
    lines = [f"run: {run}"]
    recipe = recorded_recipe(launcher_dir(run)) or recorded_recipe(run) or {}  # frozen by submit, or the run's own
    total = recipe.get("training", {}).get("steps", "?")
    lines.append(f"latest checkpoint: step {checkpoint_step(run)} of {total}")
    lines += goodput_lines(run) + slow_hosts(run)
    ids = job_ids(run)
    if not ids:
        return "\n".join(lines + local_launches(run))
    info = job_info(ids[-1])
    if info:
        lines.append(f"job {ids[-1]}: {info.get('JobState')} (reason {info.get('Reason')}, "
                     f"restarts {info.get('Restarts')}, nodes {info.get('NodeList')}, "
                     f"excluded {info.get('ExcNodeList')})")
    else:
        lines.append(f"job {ids[-1]}: unknown to the controller (it forgets ended jobs after MinJobAge), "
                     "or the controller is down")
    events = [e for e in history(run) if e["job"] == ids[-1]]
    for e in events[-6:]:
        if e["event"] == "start":
            lines.append(f"  {e['time']} start {e['restart']} on {e['nodes']} from step {e['step']}")
        else:
            lines.append(f"  {e['time']} {e['action']}: {e['why']}")
    if events and events[-1]["event"] == "end" and events[-1]["action"] == "fail":
        lines.append(f"FAILED: {events[-1]['why']}")
    return "\n".join(lines)


def slow_hosts(run: Path) -> list[str]:
    """The hosts health.straggler named (``<run>/alerts.jsonl``), with their last alert."""
    last = {a["host"]: a for a in read_alerts(run) if a.get("kind") == "straggler"}
    return ["slow hosts: " + "; ".join(f"{h} (rank {a['rank']} at step {a['step']}: compute check "
                                        f"{a['compute_s'] / a['median_s'] - 1:.0%} over the other ranks' median, {a['time']})"
                                        for h, a in last.items())] if last else []


def local_launches(run: Path) -> list[str]:
    """A run started with launch.local: its starts and ends (attempts.jsonl), as for a job."""
    events = [e for e in history(run) if str(e.get("job", "")).startswith("local-")]
    if not events:
        return ["no job submitted, no launch.local start recorded"]
    lines = [f"launch.local: {sum(e['event'] == 'start' for e in events)} starts"]
    for e in events[-6:]:
        lines.append(f"  {e['time']} start from step {e['step']}" if e["event"] == "start" else
                     f"  {e['time']} {e['action']}: {e['why']}")
    if events[-1]["event"] == "end" and events[-1]["action"] == "fail":
        lines.append(f"FAILED: {events[-1]['why']}")
    return lines


def logs(run: Path, lines: int, follow: bool) -> int:
    files = sorted(logs_dir(run).glob("*.log"))
    if not files:
        print(f"no logs yet in {logs_dir(run)}", file=sys.stderr)
        return 1
    os.execvp("tail", ["tail", "-n", str(lines), *(["-F"] if follow else []), *map(str, files)])


def cancel(run: Path) -> int:
    ids = job_ids(run)
    if not ids:
        print(f"no job submitted for {run}", file=sys.stderr)
        return 1
    return subprocess.run(["scancel", ids[-1]]).returncode


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="snapshot, write the batch script, sbatch it")
    s.add_argument("--recipe", required=True, help="recipe file, or a name in recipes/")
    s.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    s.add_argument("--nodes", type=int, default=1)
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs to request per node (0: none)")
    s.add_argument("--nproc-per-node", type=int, help="ranks per node (default: --gpus-per-node)")
    s.add_argument("--partition")
    s.add_argument("--account")
    s.add_argument("--time", help="time limit, e.g. 24:00:00")
    s.add_argument("--exclude", help="nodes not to run on, e.g. 'node[017,042]'")
    s.add_argument("--no-exclusive", action="store_true", help="share nodes with other jobs")
    s.add_argument("--signal-lead", type=int, default=300,
                   help="seconds before the time limit to checkpoint and requeue")
    s.add_argument("--rdzv-port", type=int, help="c10d rendezvous port (default: from the job id)")
    s.add_argument("--nccl-socket-ifname", help="NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME), e.g. ib0")
    s.add_argument("--nccl-ib-hca", help="NCCL_IB_HCA, e.g. mlx5")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VAL", help="extra environment")
    s.add_argument("--dry-run", action="store_true",
                   help="print the batch script, run every check and the plan, submit nothing")
    s.add_argument("--no-preflight", action="store_true",
                   help="check only the model here, not the data, tokenizer and init_from (a login node that "
                        "cannot see them): the job checks them and fails once if they are missing")
    s.add_argument("--gpu", default="h100", help="GPU kind for the memory plan: h100, h200, a100, mi300x")
    s.add_argument("--no-plan", action="store_true",
                   help="submit without the memory plan (train.py --plan) that refuses a recipe that does not fit")
    for name, helptext in (("status", "state, progress, failure reason"), ("logs", "tail the job's logs"),
                           ("cancel", "scancel the run's job")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("run", type=Path, help="the run dir")
        if name == "logs":
            c.add_argument("-n", type=int, default=40, help="lines per log")
            c.add_argument("-f", "--follow", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "submit":
        return submit(args)
    if not launcher_dir(args.run).is_dir():
        print(f"error: {args.run} is not a run dir started with launch.slurm or launch.local", file=sys.stderr)
        return 2  # bad input
    if args.command == "status":
        print(status(args.run))
        return 0
    if args.command == "logs":
        return logs(args.run, args.n, args.follow)
    return cancel(args.run)


if __name__ == "__main__":
    sys.exit(main())
