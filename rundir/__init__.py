"""The run directory: one torch-free owner of where a run keeps what.

Training writes a run dir, and the launchers, the converter and the evaluators
read it; they all take names and rules from here, so that "the latest complete
checkpoint" means the same thing everywhere. Importing this costs no torch, so
a SLURM batch script can use it::

    <run>/recipe.toml                 the resolved recipe
    <run>/laneformer_config.json      the model config (for export and eval)
    <run>/metrics.jsonl               every logged metric
    <run>/evals/step-<N>.json         in-loop evaluations
    <run>/checkpoints/step-<N>/       DCP checkpoints; complete once ``.metadata`` exists
    <run>/launches/<n>/               per-launch snapshot (started, git-commit, git-status, git.diff,
                                      packages.txt, code/)
    <run>/launcher/                   attempts.jsonl, exit.json, the frozen recipe, jobs, job.sbatch
    <run>/launcher/logs/              batch.log and node<t>-<host>.log (SLURM), local/ (launch.local)
    <run>/launcher/heartbeat/         each rank's heartbeat and stack dump
    <run>/alerts.jsonl                what the ranks flag for people (stragglers, replica mismatches)
    <run>/rollbacks.jsonl             spike rollbacks
    <run>/stalls/<attempt>/           a stalled launch's stacks and stall.json
    <run>/report/report.html          the run report (and refresh.log)
    <run>/plan.json                   the memory plan the report draws (report --plan-gpu)
    <run>/hf/                         the end-of-run Hugging Face export (default)
    <run>/tensorboard/, compile_cache/
    <run>/reference_logps/            a preference run's reference log-probs, <role>-<key>.npy, and
                                      inputs.json (the init checkpoint and what each key holds)
    <sweep>/sweep.json                a sweep dir (launch.sweep): its record, a dir per run, logs/,
    <sweep>/comparison.csv ...        and report's comparison.csv, summary.csv, report.html

Run dirs go to ``runs/<name>`` in the repo unless a recipe says otherwise; sweeps to ``runs/sweeps/<name>``.

Every file name under a run dir or a sweep dir is defined here, once, and imported by
its writers and readers alike (tests/rundir/test_names.py holds the rest of the repo to it).

It also holds what every entry point shares: the repo root (``REPO``) and the
one ``--set key=value`` grammar (``parse_set``) of train.py, convert and
eval.run. train.py's exit codes are ``health.exits``'.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # the repository root

RECIPE_FILE = "recipe.toml"
MODEL_CONFIG_FILE = "laneformer_config.json"
METRICS_FILE = "metrics.jsonl"
EVALS_DIR = "evals"
CHECKPOINTS_DIR = "checkpoints"
LAUNCHER_DIR = "launcher"
LAUNCHES_DIR = "launches"
EXPORT_DIR = "hf"  # the end-of-run Hugging Face export, unless [checkpoint] export_dir says otherwise
TENSORBOARD_DIR = "tensorboard"
COMPILE_CACHE_DIR = "compile_cache"  # [run] compile_cache's default
REFERENCE_LOGPS_DIR = "reference_logps"  # a preference run's reference log-probs (train.preference.reference)
# under reference_logps/: one role's (train, held_out) log-probs (str.format(role=R, key=K)), and what the
# keys hold, recorded at step 0 (the init checkpoint's step and digest: a resumed run keys by these)
REFERENCE_LOGPS_FILE = "{role}-{key}.npy"
REFERENCE_INPUTS_FILE = "inputs.json"
ALERTS_FILE = "alerts.jsonl"
ROLLBACKS_FILE = "rollbacks.jsonl"
STALLS_DIR = "stalls"
STALL_FILE = "stall.json"  # in stalls/<attempt>/
REPORT_DIR = "report"
REPORT_PAGE = "report.html"  # in report/
REPORT_LOG = "refresh.log"  # in report/: the in-run refresh's output
VERIFIED_FILE = "replicas_verified.json"  # in a checkpoint's step-N dir: its replicas were compared
PLAN_FILE = "plan.json"  # python -m report RUN --plan-gpu KIND traces the memory plan into it
# under launches/<n>/: what a launch ran (train.snapshot writes it, report reads it)
STARTED_FILE = "started"
GIT_COMMIT_FILE = "git-commit"
GIT_STATUS_FILE = "git-status"
GIT_DIFF_FILE = "git.diff"
PACKAGES_FILE = "packages.txt"
CODE_DIR = "code"
# under launcher/
ATTEMPTS_FILE = "attempts.jsonl"
EXIT_FILE = "exit.json"
HEARTBEAT_DIR = "heartbeat"
LOGS_DIR = "logs"  # also in a sweep dir: launch.local's output, a file per run
CLAIMS_DIR = "claims"  # in launcher/: one file per claim of the run dir (health.holder)
CLAIM_FILE = "claim-{number:06d}.json"  # in claims/: the claims in the order they were made
CLAIM_RE = re.compile(r"claim-(\d+)\.json")  # CLAIM_FILE's number
JOBS_FILE = "jobs"  # launch.slurm: the run's job ids, one a line
SBATCH_FILE = "job.sbatch"  # launch.slurm: the batch script it submitted
# under launcher/heartbeat/ and stalls/<attempt>/, one file a rank (str.format(rank=R); rank="*" to glob)
BEAT_FILE = "rank-{rank}.json"
STACKS_FILE = "rank-{rank}.stacks"  # faulthandler's dump
STALL_STACKS_FILE = "rank-{rank}.txt"  # in stalls/<attempt>/: the dump with what the watchdog knew
# under launcher/logs/
BATCH_LOG = "batch.log"  # the SLURM batch script's own output
NODE_LOG = "node%t-%N.log"  # srun's --output: each node's torchrun (SLURM fills in the task %t and host %N)
NODE_LOG_RE = re.compile(r"node(\d+)-(.+)\.log")  # NODE_LOG as srun filled it in
LOCAL_LOGS_DIR = "local"  # launch.local's torchrun --log-dir, a folder per start
# a sweep dir: its runs' dirs, LOGS_DIR, and report's comparison (REPORT_PAGE too)
SWEEP_FILE = "sweep.json"
COMPARISON_FILE = "comparison.csv"
SUMMARY_FILE = "summary.csv"
# in the repo: where run dirs and sweep dirs go by default (runs/<name>, runs/sweeps/<name>)
RUNS_DIR = "runs"
SWEEPS_DIR = "sweeps"

STEP_DIR = "step-{step}"  # in checkpoints/: one checkpoint (torchtitan's name; str.format(step=N), step="*" to glob)
_STEP = re.compile(r"step-(\d+)")


def step_number(folder: Path) -> int | None:
    """N for a folder named ``step-N``, else None."""
    m = _STEP.fullmatch(Path(folder).name)
    return int(m.group(1)) if m else None


def is_complete(step_dir: Path) -> bool:
    """DCP writes ``.metadata`` last: without it a step folder is half-written."""
    return (Path(step_dir) / ".metadata").is_file()


def checkpoints_dir(run: Path) -> Path:
    return Path(run) / CHECKPOINTS_DIR


def checkpoint_of(folder: Path, step: int) -> Path:
    """The checkpoint of ``step`` in a checkpointer's folder (``STEP_DIR``: torchtitan's name for it)."""
    return Path(folder) / STEP_DIR.format(step=step)


def step_dir(run: Path, step: int) -> Path:
    return checkpoint_of(checkpoints_dir(run), step)


def complete_steps(run: Path) -> list[int]:
    """Steps of the run's complete checkpoints, oldest first."""
    folder = checkpoints_dir(run)
    if not folder.is_dir():
        return []
    return sorted(n for p in folder.iterdir() if (n := step_number(p)) is not None and is_complete(p))


def latest_complete_step(run: Path) -> int | None:
    steps = complete_steps(run)
    return steps[-1] if steps else None


def run_of(step: Path) -> Path | None:
    """The run a ``<run>/checkpoints/step-N`` belongs to; None for a step dir outside a run
    (a ``convert from-hf`` import)."""
    step = Path(step)
    return step.parent.parent if step.parent.name == CHECKPOINTS_DIR else None


def recorded_recipe(folder: Path) -> dict | None:
    """The recipe a run recorded (``<folder>/recipe.toml``: a run dir's resolved recipe, or the
    launcher's frozen one), as the TOML dict train.recipe wrote; None if there is none. The one
    raw reader, for readers below train (data, models) that cannot load the schema."""
    path = Path(folder) / RECIPE_FILE
    return tomllib.loads(path.read_text()) if path.is_file() else None


def in_repo(path: str | Path) -> Path:
    """A recipe's path value as a path: relative ones are relative to the repo root."""
    return Path(path) if Path(path).is_absolute() else REPO / path


def writable(folder: Path) -> bool:
    """Whether ``folder`` can be created or written: its nearest existing ancestor is a writable dir."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def latest_complete_checkpoint(run: Path) -> Path | None:
    """The newest complete ``checkpoints/step-N`` of a run dir, or None."""
    step = latest_complete_step(run)
    return None if step is None else step_dir(run, step)


def read_jsonl(path: Path) -> list[dict]:
    """Every row of a JSON-lines file, oldest first; [] if it does not exist. A last line cut
    by a kill (no newline, not JSON) is dropped; any other bad line raises ValueError naming
    the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if n == len(lines) and not text.endswith("\n"):
                break  # the writer was killed mid-line
            raise ValueError(f"{path}: line {n}: not a JSON object ({e}): {line[:80]!r}") from None
    return rows


def read_metrics(run: Path) -> list[dict]:
    """Every row of a run's ``metrics.jsonl``, oldest first; [] before the first is logged."""
    return read_jsonl(Path(run) / METRICS_FILE)


def last_logged(run: Path, key: str) -> tuple[int, float] | None:
    """(step, value) of the last ``key`` in a run's metrics.jsonl, or None."""
    rows = [row for row in read_metrics(run) if key in row]
    return (rows[-1]["step"], rows[-1][key]) if rows else None


def eval_file(run: Path, step: int) -> Path:
    """Where the in-loop eval of ``step`` is written."""
    return Path(run) / EVALS_DIR / f"step-{step}.json"


def eval_files(run: Path) -> dict[int, Path]:
    """Every in-loop eval of the run, by step."""
    found = ((step_number(p.with_suffix("")), p) for p in (Path(run) / EVALS_DIR).glob("step-*.json"))
    return {n: p for n, p in found if n is not None}


def latest_evals(run: Path) -> dict[str, float] | None:
    """The metrics of the run's latest in-loop eval, or None before the first."""
    reports = eval_files(run)
    return json.loads(reports[max(reports)].read_text())["metrics"] if reports else None


def launcher_dir(run: Path) -> Path:
    """What the launchers keep: attempts.jsonl, exit.json, logs/, the frozen recipe."""
    return Path(run) / LAUNCHER_DIR


def exit_file(run: Path) -> Path:
    """Where train.py writes why it stopped (the launchers set ``$LANEFORMER_EXIT_FILE`` to it)."""
    return launcher_dir(run) / EXIT_FILE


def attempts_file(run: Path) -> Path:
    """Every start and end of a launch (launch.attempts writes it; goodput and status read it)."""
    return launcher_dir(run) / ATTEMPTS_FILE


def logs_dir(run: Path) -> Path:
    """The launchers' logs: SLURM's batch.log and a log per node, launch.local's folder per start."""
    return launcher_dir(run) / LOGS_DIR


def claims_dir(run: Path) -> Path:
    """The claims of the run dir, one file each, made with link(2) so that exactly one launch makes each
    (health.holder)."""
    return launcher_dir(run) / CLAIMS_DIR


def claim_file(run: Path, number: int) -> Path:
    return claims_dir(run) / CLAIM_FILE.format(number=number)


def claim_numbers(run: Path) -> list[int]:
    """The numbers of the run dir's claims, newest first."""
    found = (CLAIM_RE.fullmatch(f.name) for f in claims_dir(run).glob("claim-*.json"))
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def heartbeat_dir(run: Path) -> Path:
    """Each rank's ``rank-<R>.json`` heartbeat and ``rank-<R>.stacks`` dump (health.heartbeat)."""
    return launcher_dir(run) / HEARTBEAT_DIR


def beat_file(run: Path, rank: int) -> Path:
    """A rank's heartbeat (health.heartbeat writes it, launch.watchdog and goodput read it)."""
    return heartbeat_dir(run) / BEAT_FILE.format(rank=rank)


def stacks_file(run: Path, rank: int) -> Path:
    """Where a rank's faulthandler dumps its stacks on the watchdog's signal."""
    return heartbeat_dir(run) / STACKS_FILE.format(rank=rank)


def alerts_file(run: Path) -> Path:
    return Path(run) / ALERTS_FILE


def rollbacks_file(run: Path) -> Path:
    return Path(run) / ROLLBACKS_FILE


def stall_dir(run: Path, attempt: str) -> Path:
    """Where the watchdog puts a stalled launch's stacks and ``stall.json``."""
    return Path(run) / STALLS_DIR / attempt


def report_dir(run: Path) -> Path:
    return Path(run) / REPORT_DIR


def model_config_file(path: Path) -> Path:
    """``laneformer_config.json`` in ``path`` if it is a folder, else ``path`` itself."""
    path = Path(path)
    return path / MODEL_CONFIG_FILE if path.is_dir() else path


def write_model_config(folder: Path, fields: dict) -> None:
    """Write a model's native config fields to ``<folder>/laneformer_config.json``."""
    (Path(folder) / MODEL_CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n")


def read_model_config(path: Path) -> dict:
    """The native config fields in ``laneformer_config.json`` (the file, or a folder holding it)."""
    return json.loads(model_config_file(path).read_text())


def parse_set(item: str) -> tuple[str, Any]:
    """One ``--set key=value``, the grammar every CLI shares: the value is read as a
    TOML value (``3``, ``1e-4``, ``true``, ``[0, 1]``, ``"text"``), else taken as a
    bare string. Raises ValueError without ``=``."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: expected key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key.strip(), value
