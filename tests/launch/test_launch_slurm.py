"""launch.slurm against a real SLURM on this machine (launch/ci/slurm.sh: two
emulated nodes): runs to the end on 2 nodes x 1 rank and resumes on 1 node x 2 ranks,
preemption -> checkpoint -> requeue -> resume, then a stopped rank -> stall
(stacks, killed) -> requeue -> resume, with the losses of an uninterrupted run
and its goodput in status, a rank killed on node 2 -> requeue with node 2
excluded -> resume on node 1 with the same losses, a recipe error that fails once,
status, logs and cancel.
Where SLURM cannot start here the tests are skipped with the reason."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import attempts
from health import goodput
from launch.attempts import checkpoint_step, history, job_info
from launch.slurm import job_ids
from launch.slurm import main as slurm_main
from launch.sweep.runs import state as sweep_state
from rundir import REPO
from tests.conftest import SHORT, STEPS, losses
from tests.launch.conftest import logged_steps, wait_for
from tests.launch.test_launch_local import STALL_TIMEOUT, stall_in_time, started_at
from tests.launch.test_sweep import SHORT as SWEEP_SHORT
from tests.launch.test_sweep import sweep_cli

SLURM_SH = REPO / "launch" / "ci" / "slurm.sh"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
JOB_ENV = ("--env=OMP_NUM_THREADS=1", "--env=WANDB_MODE=offline", "--env=WANDB_SILENT=true")
NO_REPORT = "logging.report=false"  # no test here reads a run's report: drawing it is a process at each end of a job


def unavailable(reason: str) -> None:
    """In CI (``CI=true``) the requeue proofs must run: no SLURM fails. Elsewhere they skip, saying why."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm():
    """A local SLURM for the session; stopped afterwards unless it was already up (CI may start it)."""
    if os.geteuid() != 0:
        unavailable("a local SLURM needs root: launch/ci/slurm.sh installs packages and starts daemons")
    up = subprocess.run([str(SLURM_SH), "up"], capture_output=True, text=True, timeout=900)
    if up.returncode != 0:
        unavailable(f"launch/ci/slurm.sh up failed: {(up.stderr or up.stdout).strip()[-1500:]}")
    yield
    if "already up" not in up.stdout:
        subprocess.run([str(SLURM_SH), "down"], capture_output=True, timeout=120)


def slurm_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.slurm", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=180)


SUBMITTED: list[str] = []


@pytest.fixture(autouse=True)
def cancel_leftovers():
    """A failed test must not leave its job running into the next one."""
    yield
    if SUBMITTED:
        subprocess.run(["scancel", *SUBMITTED], capture_output=True)
        SUBMITTED.clear()


def submit(run: Path, *args: str, recipe: str = "tiny.toml", nodes: int = 1, nproc: int = 2) -> str:
    """``launch.slurm submit`` in this process (it imports the model code once, not per job)."""
    assert slurm_main(["submit", "--recipe", recipe, f"--nodes={nodes}", "--gpus-per-node=0",
                       f"--nproc-per-node={nproc}", "--no-exclusive", *JOB_ENV,
                       *(f"--set={s}" for s in (f"run.output_dir={run}", *SHORT, NO_REPORT)), *args]) == 0
    SUBMITTED.append(job_ids(run)[-1])
    return SUBMITTED[-1]


def state(job: str) -> str:
    return job_info(job).get("JobState", "")


def wait_done(job: str, run: Path, timeout: float = 180) -> str:
    try:
        return wait_for(lambda: (s := state(job)) in DONE and s, f"job {job} to end", timeout)
    except AssertionError:
        logs = "\n".join(p.read_text()[-2000:] for p in sorted((run / "launcher" / "logs").glob("*.log")))
        raise AssertionError(f"job {job} still {state(job)} after {timeout} s\n{logs}") from None


@pytest.mark.slow
def test_two_nodes_run_to_the_end_and_a_resubmission_resumes_on_another_node(slurm, reference, tmp_path):
    """2 nodes x 1 rank meet on the first node and train as the 2-rank reference does (1 node x 2
    ranks trains in the preemption and node-failure tests below); a resubmission, 1 node x 2 ranks
    with the first node excluded, resumes from the last step."""
    run = tmp_path / "run"
    job = submit(run, nodes=2, nproc=1)
    assert wait_done(job, run, timeout=300) == "COMPLETED"
    assert len(list((run / "launcher" / "logs").glob("node[01]-*.log"))) == 2  # one log per node
    assert losses(run) == reference  # the same 2-rank data-parallel run
    assert (run / "launches" / "001" / "code" / "train.py").exists()  # the submit-time snapshot
    assert "#SBATCH --requeue" in (run / "launcher" / "job.sbatch").read_text()
    status = slurm_cli("status", str(run)).stdout
    assert f"latest checkpoint: step {STEPS} of {STEPS}" in status and "done: finished" in status
    logs = slurm_cli("logs", str(run), "-n", "200").stdout
    assert "Training completed" in logs and f"finished at step {STEPS}" in logs
    again = submit(run, "--exclude=lfnode1")  # a resubmission resumes the run, elsewhere
    assert wait_done(again, run, timeout=300) == "COMPLETED"
    starts = [(e["nodes"], e["step"]) for e in history(run) if e["event"] == "start"]
    assert starts == [("lfnode[1-2]", 0), ("lfnode2", STEPS)]
    assert len(list((run / "launches").iterdir())) == 4  # a snapshot per submission and per start


def starts(run: Path) -> int:
    return sum(e["event"] == "start" for e in history(run))


def ended(run: Path, cause: str) -> list[dict]:
    """The ends in attempts.jsonl with this cause (launch.attempts writes one as each start ends)."""
    return [e for e in history(run) if e["event"] == "end" and e.get("cause") == cause]


def wait_restart(job: str, run: Path, after: int, what: str, timeout: float = 240) -> dict:
    """The start after the ``after``-th in attempts.jsonl: the requeued job running again. A requeued job
    waits cred_expire + 1 s in PENDING before it may start; seen PENDING, it is told to start now (not
    at once: slurmd refuses a credential issued in the same second it revoked the old one). It may also
    be seen in no PENDING poll at all (nodes idle: straight back to RUNNING), so the wait is for the start
    event, and telling it to start is only a shortcut."""
    hurried = []

    def started():
        if starts(run) > after:
            return True
        if not hurried and state(job) == "PENDING":
            time.sleep(1.5)
            hurried.append(subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                                          capture_output=True, text=True))
        return None

    wait_for(started, what, timeout, detail=lambda: (state(job), history(run), hurried))
    return [e for e in history(run) if e["event"] == "start"][after]


@pytest.mark.slow
def test_preemption_then_a_stall_requeue_and_resume_with_the_same_losses(slurm, reference, tmp_path):
    run = tmp_path / "run"
    job = submit(run, f"--set=launch.stall_timeout={STALL_TIMEOUT}",
                 f"--set=launch.stall_timeout_checkpoint={STALL_TIMEOUT}")
    # Every wait is for an event in the run dir (a logged step, an end or start in attempts.jsonl, a complete
    # checkpoint), with limits several times what each takes on an idle machine.
    wait_for(lambda: logged_steps(run) >= 3, "step 3", timeout=300, detail=lambda: (state(job), history(run)))
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)  # what --signal=B:USR1@N sends
    preempted = wait_for(lambda: ended(run, "preempted"), "the preemption's end", 180,
                         lambda: (state(job), history(run)))[0]["step"]
    node = wait_restart(job, run, 1, "the preemption's requeue to start")["nodes"]
    wait_for(lambda: checkpoint_step(run) > preempted, "a checkpoint after the requeue", 300, lambda: history(run))
    os.kill(wait_for(lambda: process_of(job, node, 1), "rank 1"), signal.SIGSTOP)  # stalls every rank
    wait_for(lambda: ended(run, "stall"), "the stall's end", 180, lambda: (state(job), history(run)))
    wait_restart(job, run, 2, "the stall's requeue to start")
    assert wait_done(job, run, timeout=300) == "COMPLETED"
    assert job_info(job)["Restarts"] == "2"
    ends = [e for e in history(run) if e["event"] == "end"]
    assert [(e["action"], e["cause"]) for e in ends] == [
        ("restart", "preempted"), ("restart", "stall"), ("done", "finished")], ends
    starts = [e for e in history(run) if e["event"] == "start"]
    assert starts[1]["step"] == ends[0]["step"] > 0  # the preemption checkpoint, on disk ...
    log = "".join(p.read_text() for p in sorted((run / "launcher" / "logs").glob("node*.log")))
    # ... is where training resumed; then from the newest checkpoint before the stall
    assert started_at(log) == [1, starts[1]["step"] + 1, starts[2]["step"] + 1], log[-3000:]
    assert starts[2]["step"] > starts[1]["step"]
    assert losses(run) == reference
    stall = json.loads((run / "stalls" / "002" / "stall.json").read_text())
    assert stall_in_time(stall), stall  # the watchdog's bound, at the rounding it writes
    assert [(r["rank"], r["state"] == "T", r["stacks"]) for r in stall["ranks"]] == [(0, False, True), (1, True, False)]
    assert "Current thread" in (run / "stalls" / "002" / "rank-0.txt").read_text()
    # Goodput for a run preempted once and stalled once: each cause cost something, the stall at least its
    # timeout (measured from the last beat to the end in attempts.jsonl, whose times are written to the second).
    a = goodput.account(run)
    assert 0 < a["goodput"] < 1 and a["productive_s"] + sum(a["costs"].values()) <= a["wall_s"] + 1e-6, a
    assert a["costs"]["stalls"] > STALL_TIMEOUT - 1 and a["costs"]["preemptions"] > 0 and a["costs"]["restarts"] > 0, a
    assert [list(split) for split in a["startups"]] == [
        ["process", "imports", "rendezvous", "build", "checkpoint load", "first step"]] * 3, a["startups"]
    text = slurm_cli("status", str(run)).stdout
    assert re.search(r"^goodput: \d+\.\d%", text, re.M) and "stalls" in text and "preemptions" in text, text


def process_of(job: str, node: str, rank: int) -> int | None:
    """The pid of training rank ``rank`` of SLURM job ``job`` running on emulated node ``node``."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURMD_NODENAME={node}".encode(), f"RANK={rank}".encode()}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if want <= set(environ.read_bytes().split(b"\0")):
                return int(environ.parent.name)
        except OSError:
            continue
    return None


@pytest.mark.slow
def test_a_rank_killed_on_a_node_requeues_without_that_node_and_resumes_with_the_same_losses(
        slurm, reference, tmp_path):
    blocker = subprocess.run(["sbatch", "--parsable", "--nodelist=lfnode1", "--exclusive", "--output=/dev/null",
                              "--wrap=sleep 600"], capture_output=True, text=True, check=True).stdout.strip()
    SUBMITTED.append(blocker)
    wait_for(lambda: state(blocker) == "RUNNING", "the job holding lfnode1")
    run = tmp_path / "run"
    job = submit(run)  # lfnode1 is taken: it runs on lfnode2
    wait_for(lambda: checkpoint_step(run) >= 4 and logged_steps(run) >= 6, "a checkpoint and step 6", timeout=300)
    assert history(run)[0]["nodes"] == "lfnode2"
    os.kill(wait_for(lambda: process_of(job, "lfnode2", 1), "rank 1"), 9)  # as the OOM killer or a bad node would
    # The requeued job cannot start while lfnode1 is held and lfnode2 excluded: PENDING with the exclusion
    # is a state that stays, not one seen in passing.
    try:
        wait_for(lambda: ended(run, "crash") and state(job) == "PENDING" and job_info(job)["ExcNodeList"] == "lfnode2",
                 "the requeue without lfnode2", timeout=180)
    except AssertionError:
        batch = (run / "launcher" / "logs" / "batch.log").read_text()[-3000:]
        raise AssertionError(f"{job_info(job)}\n{history(run)}\n{batch}") from None
    subprocess.run(["scancel", blocker], check=True)
    wait_restart(job, run, 1, "the requeue to start on lfnode1")
    assert wait_done(job, run, timeout=300) == "COMPLETED"
    ends = [e for e in history(run) if e["event"] == "end"]
    assert [(e["action"], e["cause"], e.get("pinned")) for e in ends] == [
        ("restart", "crash", ["lfnode2"]), ("done", "finished", None)], ends
    starts = [e for e in history(run) if e["event"] == "start"]
    assert [e["nodes"] for e in starts] == ["lfnode2", "lfnode1"]
    # srun names the logs by the node's host name (%N), the same for emulated nodes on one host: read them all
    log = "".join(p.read_text() for p in sorted((run / "launcher" / "logs").glob("node*.log")))
    assert starts[1]["step"] >= 4  # the checkpoint before the kill ...
    assert started_at(log) == [1, starts[1]["step"] + 1], log[-3000:]  # ... is where it resumed
    assert losses(run) == reference
    status = slurm_cli("status", str(run)).stdout
    assert "excluding lfnode2 from the requeue" in status and "excluded lfnode2" in status, status


def test_a_node_the_controller_reports_down_is_pinned(slurm):
    assert attempts.hostnames("lfnode[1-2]") == ["lfnode1", "lfnode2"]
    assert attempts.down_nodes("lfnode[1-2]") == set()
    subprocess.run(["scontrol", "update", "NodeName=lfnode2", "State=DOWN", "Reason=laneformer-test"], check=True)
    try:
        assert attempts.down_nodes("lfnode[1-2]") == {"lfnode2"}
    finally:
        subprocess.run(["scontrol", "update", "NodeName=lfnode2", "State=RESUME"], check=True)
    wait_for(lambda: attempts.down_nodes("lfnode[1-2]") == set(), "lfnode2 back", timeout=30)


@pytest.mark.slow
def test_a_recipe_error_fails_the_job_once_and_status_says_why(slurm, tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text((REPO / "recipes" / "tiny.toml").read_text().replace(
        "assets/sample_data/code", "assets/sample_data/nope"))
    run = tmp_path / "run"
    job = submit(run, "--no-preflight", recipe=str(recipe))  # a login node that cannot see the data
    assert wait_done(job, run, timeout=300) == "FAILED"
    assert job_info(job)["Restarts"] == "0"
    assert [e["event"] for e in history(run)] == ["start", "end"]
    status = slurm_cli("status", str(run)).stdout
    assert re.search(r"FAILED: recipe error: .*assets/sample_data/nope", status), status


@pytest.mark.slow
def test_a_running_run_is_not_submitted_twice_and_cancel_stops_it(slurm, tmp_path):
    run = tmp_path / "run"
    job = submit(run)
    again = slurm_cli("submit", "--recipe", "tiny.toml", "--gpus-per-node=0", "--nproc-per-node=2",
                      f"--set=run.output_dir={run}", *(f"--set={s}" for s in (*SHORT, NO_REPORT)))
    assert again.returncode == 1 and f"job {job} of {run} is still queued or running" in again.stderr
    assert slurm_cli("cancel", str(run)).returncode == 0
    assert wait_done(job, run, timeout=120) == "CANCELLED"
    assert "CANCELLED" in slurm_cli("status", str(run)).stdout


def test_the_24_node_script_holds_rendezvous_signal_and_requeue(tmp_path):
    result = slurm_cli("submit", "--recipe", "phase1.toml", "--nodes", "24", "--gpus-per-node", "8",
                       "--partition", "gpu", "--account", "lm", "--time", "24:00:00", "--exclude", "gpu[017,042]",
                       "--nccl-socket-ifname", "ib0", "--nccl-ib-hca", "mlx5", "--env", "NCCL_DEBUG=WARN",
                       f"--set=run.output_dir={tmp_path / 'run'}", "--dry-run", "--no-preflight", "--no-plan")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    for line in ("#SBATCH --nodes=24", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=lm", "#SBATCH --time=24:00:00",
                 "#SBATCH --exclude=gpu[017,042]", "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "export NCCL_SOCKET_IFNAME=ib0", "export NCCL_IB_HCA=mlx5",
                 "export NCCL_DEBUG=WARN", 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 'read -r action exclude <<<"$decision"', 'scontrol requeue "$SLURM_JOB_ID"',
                 'scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude" && '
                 '{ echo "$(date -Is) requeued without $exclude"; break; }'):
        assert line in [x.strip() for x in script.splitlines()], line
    for part in ("--nnodes=24 --nproc-per-node=8", "--rdzv-backend=c10d", '--rdzv-endpoint="$head:$port"',
                 "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--kill-on-bad-exit=1",
                 "trap ", 'kill -USR1 "$srun_pid"'):
        assert part in script, part
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_a_recipe_that_does_not_fit_the_allocation_is_not_submitted(tmp_path):
    result = slurm_cli("submit", "--recipe", "tiny.toml", "--nodes", "3", "--gpus-per-node", "1",
                       f"--set=run.output_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "not divisible by micro_batch (8) x data-parallel size (3)" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_sweep_submits_through_launch_slurm_and_its_run_finishes(slurm, tmp_path):
    """launch.sweep --slurm: each run is a launch.slurm submission; the rerun submits nothing."""
    one = tmp_path / "one.toml"
    one.write_text('recipe = "tiny.toml"\nseeds = [3]\nbaseline = { "model.delay" = 2 }\n[vary]\n'
                   "model.delay = [2]\n")
    root = tmp_path / "one"
    args = (str(one), f"--root={root}", "--slurm", "--nodes=1", "--gpus-per-node=0", "--nproc-per-node=1",
            "--slurm-arg=--no-exclusive", *(f"--slurm-arg={e}" for e in JOB_ENV),
            *(f"--set={s}" for s in SWEEP_SHORT))
    run = root / "delay=2-seed3"
    first = sweep_cli(*args)
    SUBMITTED.extend(job_ids(run))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "submitted job" in first.stdout
    wait_for(lambda: sweep_state(run) == "done", "the sweep's SLURM job to finish", timeout=480)
    again = sweep_cli(*args)
    assert "starting 0: nothing" in again.stdout and "runs: 1 done" in again.stdout
    assert json.loads((root / "sweep.json").read_text())["runs"][0]["state"] == "done"
    assert (run / "launcher" / "job.sbatch").is_file()  # launch.slurm's own batch script ran it
