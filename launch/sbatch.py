"""The batch script for one run: multi-node torchrun under srun, preemption-aware.

What it does, and why each piece is there:

- ``launch.attempts begin`` first: a run dir that another launch's live ranks
  hold is refused (exit 2, ``health.holder``: the job fails, it is not
  requeued) before the start is recorded or the old heartbeats cleared;
- one srun task per node, each a torchrun agent; the agents meet in a c10d
  rendezvous on the job's first node (the same script runs on 1 or 24 nodes);
- ``--signal=B:USR1@N`` asks SLURM to signal the batch shell N seconds before
  the time limit (and on preemption); the shell forwards it to srun, which
  passes it to every task. torchrun is told to handle SIGUSR1 (it would die on
  it otherwise) and forwards it to the ranks, waiting ``shutdown_timeout`` for
  the preemption checkpoint; the ranks agree on a step, save and exit;
- afterwards ``launch.attempts end`` decides: finished, ``scontrol requeue``
  (``--requeue``: the same job id starts again and train.py resumes from the
  latest checkpoint), or fail with the reason recorded for ``status``. A crash
  pinned to a node requeues with that node added to the job's ExcNodeList
  (only a pending job can be updated: requeue first, with SIGTERM ignored so
  the requeue's own signal does not cut the update off); with ``[launch]
  exclude_stragglers`` the nodes the straggler check named are excluded the same way;
- ``launch.watchdog`` runs beside srun on the first node: a start that makes
  no progress for ``[launch] stall_timeout`` gets its ranks' stacks dumped
  and is killed, and ``launch.attempts end`` records the cause ``stall``;
- ``--open-mode=append`` so a restart does not truncate the logs; absolute
  interpreter paths because sbatch exports the submitting environment.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rundir import BATCH_LOG, NODE_LOG, REPO, exit_file, logs_dir
from health.exits import EXIT_FILE_ENV
from health.heartbeat import LAUNCH_ENV

SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(kw_only=True)
class Job:
    run_dir: Path
    recipe: Path  # the frozen recipe the job trains
    name: str
    nodes: int
    gpus_per_node: int  # requested from SLURM; 0: no GPUs (CPU test clusters)
    nproc_per_node: int  # ranks per node
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    exclude: str | None = None
    exclusive: bool = True
    signal_lead: int = 300  # seconds between the signal and the time limit: the save must fit
    crashes_per_day: int = 0  # crash requeues (after progress) allowed per 24 h, 0: any; preemptions always requeue
    exclude_stragglers: bool = False  # [launch] exclude_stragglers: a requeue leaves out the nodes named slow
    rdzv_port: int | None = None  # default: derived from the job id, so jobs sharing a node differ
    nccl_socket_ifname: str | None = None
    nccl_ib_hca: str | None = None
    env: list[str] = field(default_factory=list)  # extra KEY=VAL for every rank
    python: str = sys.executable


def environment(job: Job) -> list[str]:
    """KEY=VAL lines the ranks need: the network settings, then the user's."""
    env = []
    if job.nccl_socket_ifname:  # the interface for bootstrap / socket traffic (gloo too)
        env += [f"NCCL_SOCKET_IFNAME={job.nccl_socket_ifname}", f"GLOO_SOCKET_IFNAME={job.nccl_socket_ifname}"]
    if job.nccl_ib_hca:
        env.append(f"NCCL_IB_HCA={job.nccl_ib_hca}")
    for item in job.env:
        key, sep, _ = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--env {item!r}: expected KEY=VALUE")
        env.append(item)
    return env


def render(job: Job) -> str:
    q = shlex.quote
    run, logs = job.run_dir, logs_dir(job.run_dir)
    directives = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *(["--exclusive"] if job.exclusive else []),
        *(f"--{k}={v}" for k, v in (("partition", job.partition), ("account", job.account),
                                      ("time", job.time), ("exclude", job.exclude)) if v),
        f"--signal=B:USR1@{job.signal_lead}",
        "--requeue",
        "--open-mode=append",
        f"--output={logs / BATCH_LOG}",
    ]
    torchrun = Path(job.python).parent / "torchrun"
    port = job.rdzv_port or "$((20000 + SLURM_JOB_ID % 20000))"
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        f"# Written by `python -m launch.slurm submit` for {run}; see launch/sbatch.py.",
        "set -u",
        f"cd {q(str(REPO))}",
        f"RUN={q(str(run))}",
        f"PY={q(job.python)}",
        *(f"export {k}={q(v)}" for k, _, v in (e.partition("=") for e in environment(job))),
        f"export {EXIT_FILE_ENV}={q(str(exit_file(run)))}",
        f'export {LAUNCH_ENV}="$SLURM_JOB_ID"',  # the ranks hold the job's claim of the run dir
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port={port}",
        'echo "$(date -Is) job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"',
        '"$PY" -m launch.attempts begin "$RUN" --job "$SLURM_JOB_ID" --restart "${SLURM_RESTART_COUNT:-0}" '
        f'--nodes "$SLURM_JOB_NODELIST" --recipe {q(str(job.recipe))} || exit $?',
        "",
        "# SLURM signals only this shell (B:); pass the signal on to every task.",
        "srun_pid=",
        'trap \'echo "$(date -Is) SIGUSR1: checkpoint and requeue"; '
        '[ -n "$srun_pid" ] && kill -USR1 "$srun_pid"\' USR1',
        f'srun --kill-on-bad-exit=1 --ntasks-per-node=1 --output={q(str(logs / NODE_LOG))} --open-mode=append \\',
        f"  {q(str(torchrun))} --nnodes={job.nodes} --nproc-per-node={job.nproc_per_node} \\",
        '  --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \\',
        f"  --signals-to-handle={SIGNALS_TO_HANDLE} --shutdown-timeout={job.signal_lead} \\",
        f"  train.py --recipe {q(str(job.recipe))} &",
        "srun_pid=$!",
        f'"$PY" -m launch.watchdog "$RUN" --job "$SLURM_JOB_ID" --pid "$srun_pid" --recipe {q(str(job.recipe))} &',
        "watchdog_pid=$!",
        "# A trapped signal interrupts `wait`: wait again until srun is gone.",
        'while :; do wait "$srun_pid"; rc=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        "srun_pid=  # a late signal must not reach a reused pid",
        'kill "$watchdog_pid" 2>/dev/null; wait "$watchdog_pid" 2>/dev/null',
        "",
        f'decision=$("$PY" -m launch.attempts end "$RUN" --job "$SLURM_JOB_ID" --rc "$rc" '
        f'--crashes-per-day {job.crashes_per_day} --nodes "$SLURM_JOB_NODELIST"'
        f'{" --exclude-stragglers" if job.exclude_stragglers else ""})',
        'read -r action exclude <<<"$decision"',
        'case "$action" in',
        "  done) exit 0 ;;",
        "  restart)",
        "    trap '' TERM  # the requeue signals this shell too; the exclusion must still be written",
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    # Only a pending job takes ExcNodeList; a busy controller may answer late (KillWait bounds this).",
        '    for try in 1 2 3 4 5; do',
        '      [ -z "$exclude" ] && break',
        '      scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude" && '
        '{ echo "$(date -Is) requeued without $exclude"; break; }',
        "      sleep 1",
        "    done",
        "    exit 0 ;;",
        "  *) exit 1 ;;",
        "esac",
    ]
    return "\n".join(lines) + "\n"
