"""One live writer per run dir (health/holder.py).

A SIGKILL of torchrun's process group leaves no rank training (torchrun starts its workers in sessions
of their own; each rank asks the kernel to die with its agent); a second launch into a run dir whose
ranks are alive is refused, exit 2, naming them, and writes nothing; once they are gone the same
command resumes and says it took the run dir over. The holder decision itself (fresh, stale, this
launch, another host) on heartbeat files written by hand; die-with-parent on plain processes."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import rundir
from rundir import REPO
from tests.conftest import env, kill_tree, losses, train, train_command
from tests.launch.conftest import wait_for
from health.exits import Exit
from health.heartbeat import launch_id, read_beats
from health.heartbeat import process_start_time as process_start
from health.holder import claim, holders, latest_claim, pid_alive
from train.recipe import Launch

HOST = socket.gethostname()
LIMITS = Launch(stall_timeout=60, stall_timeout_first_step=300, stall_timeout_checkpoint=120, stall_timeout_eval=200)


# ---- the decision, on heartbeats written by hand ----------------------------------------------


def write_beat(run: Path, rank: int, *, pid: int, host: str = HOST, launch: str = "other/0/127.0.0.1:1",
               age: float = 1.0, phase: str = "data", done: int = 5, world: int = 1, process: float | None = None):
    """A heartbeat file as health.heartbeat writes it (the fields the holder reads)."""
    folder = rundir.heartbeat_dir(run)
    folder.mkdir(parents=True, exist_ok=True)
    marks = {"trainer": time.time() - 100} | ({"process": process} if process is not None else {})
    record = {"rank": rank, "world": world, "pid": pid, "host": host, "launch": launch, "step": 7, "phase": phase,
              "done": done, "time": time.time() - age, "marks": marks, "phase_s": {}}
    (folder / f"rank-{rank}.json").write_text(json.dumps(record).ljust(2047) + "\n")


@pytest.fixture
def sleeper():
    """A live process on this host, standing in for a rank."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_no_heartbeats_no_holder(tmp_path):
    said = []
    assert claim(tmp_path / "run", LIMITS, say=said.append) is None and said == []


def test_a_live_rank_on_this_host_holds_the_run_dir_however_old_its_beat(tmp_path, sleeper):
    run = tmp_path / "run"
    write_beat(run, 0, pid=sleeper.pid, age=10_000, process=process_start(sleeper.pid))  # stopped, say
    write_beat(run, 1, pid=gone_pid(), age=10_000)
    said = []
    held = claim(run, LIMITS, say=said.append)
    assert held and said == []
    assert f"run dir {run} is held" in held and f"on {HOST}" in held and f"pid {sleeper.pid}" in held, held
    assert "id other/0/127.0.0.1:1" in held and re.search(r"last beat 1000\d\.\d s ago", held), held


def test_ranks_gone_from_this_host_are_a_stale_holder_taken_over_and_said(tmp_path):
    run = tmp_path / "run"
    dead = [gone_pid(), gone_pid()]
    for rank, pid in enumerate(dead):
        write_beat(run, rank, pid=pid, age=2.0, world=2)
    said = []
    assert claim(run, LIMITS, say=said.append) is None
    [line] = said
    assert "took over from a stale holder" in line and f"pids {dead[0]}, {dead[1]} gone from {HOST}" in line, line


def test_a_reused_pid_is_not_the_rank(tmp_path, sleeper):
    """The pid exists, but its process started long after the rank that beat did."""
    run = tmp_path / "run"
    write_beat(run, 0, pid=sleeper.pid, process=process_start(sleeper.pid) - 3600)
    [h] = holders(run, LIMITS)
    assert not h.alive and "gone" in h.why


def test_this_launchs_own_beats_are_not_a_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "mine")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "4242")
    run = tmp_path / "run"
    write_beat(run, 0, pid=os.getpid(), launch=launch_id(), process=process_start(os.getpid()))  # this process
    write_beat(run, 1, pid=12345, host="node-b", launch=launch_id(), age=0.5)  # its peer on another host
    assert holders(run, LIMITS) == []


def test_the_same_launch_id_under_another_agent_is_another_launch(tmp_path, sleeper, monkeypatch):
    """torchrun's default port and run id repeat: a killed torchrun's orphan shares a new launch's id. Its
    parent is no torchrun agent (here: this test); a sibling agent's rank is the same launch (the SLURM
    tests' two emulated nodes on one host)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    run = tmp_path / "run"
    write_beat(run, 0, pid=sleeper.pid, launch=launch_id(), process=process_start(sleeper.pid))
    assert sleeper.pid != os.getpid()  # the sleeper's parent is this process, not this process's parent
    [h] = holders(run, LIMITS)
    assert h.alive


def test_a_rank_of_another_agent_of_the_same_launch_on_this_host_is_its_own(tmp_path, monkeypatch):
    """Two nodes' torchrun agents on one host (SLURM's emulated nodes): the other agent's rank is no holder."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "20")
    agent = subprocess.Popen([sys.executable, "-c", "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
                              "print(p.pid, flush=True); time.sleep(60)", "torchrun"],  # "torchrun" in its command line
                             stdout=subprocess.PIPE, text=True)
    try:
        rank = int(agent.stdout.readline())
        run = tmp_path / "run"
        write_beat(run, 1, pid=rank, launch=launch_id(), process=process_start(rank))
        assert holders(run, LIMITS) == []
        write_beat(run, 1, pid=rank, launch="another/0/127.0.0.1:1", process=process_start(rank))
        assert [h.alive for h in holders(run, LIMITS)] == [True]  # another launch's rank under an agent: a holder
    finally:
        kill_tree(agent.pid)


def test_a_requeued_slurm_jobs_earlier_start_is_its_own(tmp_path):
    """launch.attempts begin of a requeued job: its last start's ranks on other nodes beat until a moment ago."""
    run = tmp_path / "run"
    write_beat(run, 0, pid=4242, host="node-b", launch="77/0/node-a:20077", age=2.0)
    assert holders(run, LIMITS, own="77/1/node-a:20077", job="77") == []
    [h] = holders(run, LIMITS, own="78/0/node-a:20078", job="78")  # another job's ranks
    assert h.alive


@pytest.mark.parametrize("age, phase, done, alive", [
    (30, "data", 5, True),  # within stall_timeout
    (90, "data", 5, False),  # silent past stall_timeout: the watchdog would have ended it
    (90, "checkpoint", 5, True),  # a save is allowed stall_timeout_checkpoint
    (150, "eval", 5, True),  # an eval stall_timeout_eval
    (250, "build", 0, True),  # before its first step: stall_timeout_first_step
    (400, "build", 0, False),
])
def test_ranks_on_another_host_are_alive_while_they_beat_within_the_watchdogs_allowance(
        tmp_path, age, phase, done, alive):
    run = tmp_path / "run"
    write_beat(run, 0, pid=4242, host="node-b", age=age, phase=phase, done=done)
    said = []
    held = claim(run, LIMITS, say=said.append)
    assert bool(held) == alive and bool(said) == (not alive), (held, said)
    if alive:
        assert "beating on node-b" in held and "pid 4242 on node-b" in held, held
    else:
        assert f"no beat from node-b for {age} s" in said[0], said


def test_stall_detection_off_still_lets_a_silent_holder_go_stale(tmp_path):
    run = tmp_path / "run"
    write_beat(run, 0, pid=4242, host="node-b", age=Launch().stall_timeout + 60)
    off = Launch(stall_timeout=0)
    [h] = holders(run, off)
    assert not h.alive


def test_launch_local_refuses_a_held_run_dir_before_writing_anything(tmp_path, sleeper, capsys, monkeypatch):
    """launch.local's main in this process (``python -m launch.local`` exits with what it returns); were
    the refusal broken, the torchrun it would start fails the test at once instead."""
    from launch import local

    def no_torchrun(cmd, **kwargs):
        raise AssertionError(f"launch.local started {cmd[0]}")

    monkeypatch.setattr(local.subprocess, "Popen", no_torchrun)
    run = tmp_path / "run"
    write_beat(run, 0, pid=sleeper.pid, process=process_start(sleeper.pid))
    before = tree(run)
    code = local.main(["--recipe", "tiny.toml", "--nproc", "2",
                       *(f"--set={s}" for s in (f"run.output_dir={run}", *SETS, "training.steps=2"))])
    err = capsys.readouterr().err
    assert code == Exit.BAD_INPUT, err[-3000:]
    assert "is held by another launch whose ranks are alive" in err and f"pid {sleeper.pid}" in err
    assert tree(run) == before  # no attempts.jsonl, the holder's heartbeat still there


def test_the_slurm_batch_scripts_begin_refuses_a_held_run_dir_before_writing_anything(tmp_path, sleeper):
    """``launch.attempts begin`` (the batch script's first step) checks before it clears the heartbeats:
    a SLURM job into a run dir another launch's live ranks hold exits 2, and the job is not requeued."""
    from launch.attempts import main as attempts_main

    run = tmp_path / "run"
    write_beat(run, 0, pid=sleeper.pid, process=process_start(sleeper.pid))
    before = tree(run)
    recipe = str(REPO / "recipes" / "tiny.toml")
    assert attempts_main(["begin", str(run), "--job", "42", "--recipe", recipe]) == Exit.BAD_INPUT
    assert tree(run) == before
    sleeper.kill()
    sleeper.wait()
    assert attempts_main(["begin", str(run), "--job", "42", "--recipe", recipe]) == 0  # a stale holder: taken over
    assert rundir.attempts_file(run).is_file() and not rundir.heartbeat_dir(run).exists()


# ---- at the same instant, and after an end -------------------------------------------------------


@functools.cache
def held_writes() -> dict:
    """An audit hook (sys.addaudithook, installed once, idle while the dict it returns is empty) that holds
    each thread of ``racers`` at its first write into ``folder`` (a file opened to write, a link or a
    rename made there, however the code under test makes it) on ``barrier``: no racer writes there before
    every racer has reached its own first write, so each has read and judged the folder as it was."""
    held: dict = {}
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def hook(event: str, args: tuple) -> None:
        if not held or threading.current_thread() not in held["racers"]:
            return
        if event == "open" and isinstance(args[2], int) and args[2] & writes:
            path = args[0]
        elif event in ("os.link", "os.rename", "os.symlink"):
            path = args[1]
        else:
            return
        if isinstance(path, (str, bytes, os.PathLike)) and os.path.dirname(os.fsdecode(path)) == held["folder"]:
            held["racers"].discard(threading.current_thread())
            held["barrier"].wait()

    sys.addaudithook(hook)
    return held


def test_two_launches_that_read_the_same_latest_claim_cannot_both_make_the_next(tmp_path, monkeypatch):
    """The order a claim made by check-then-write loses, made rather than waited for: two launches read
    claim 1 (stale: its process is gone) and decide to take the run dir over before either writes; each
    is held at its first write into the claims folder until the other reaches its own. link(2) lets one
    make claim 2; the other finds it made, judges it (its launch alive: this process) and is refused.
    Had each checked that claim 2 was absent and then written it, both would pass."""
    run = tmp_path / "run"
    rundir.claims_dir(run).mkdir(parents=True)
    rundir.claim_file(run, 1).write_text(json.dumps({"owner": "1", "host": HOST, "pid": gone_pid(),
                                                     "time": time.time() - 5}))
    first_read = {}

    def recorded(r: Path) -> tuple[int, dict]:
        found = latest_claim(r)
        first_read.setdefault(threading.current_thread().name, found[0])
        return found

    monkeypatch.setattr("health.holder.latest_claim", recorded)
    results, said = {}, {"a": [], "b": []}

    def launch(job: str) -> None:
        try:
            results[job] = claim(run, LIMITS, job=job, say=said[job].append)
        except Exception as e:  # a racer left alone at the barrier (it never wrote): the assertions name it
            results[job] = e

    racers = [threading.Thread(target=launch, args=(job,), name=job) for job in ("a", "b")]
    held = held_writes()
    held.update(folder=str(rundir.claims_dir(run)), barrier=threading.Barrier(2, timeout=20), racers=set(racers))
    try:
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(timeout=60)
    finally:
        held.clear()
    assert first_read == {"a": 1, "b": 1}, results  # both judged claim 1 the latest
    passed = [job for job, result in results.items() if result is None]
    assert len(passed) == 1 and len(results) == 2, results
    winner, loser = passed[0], ({"a", "b"} - set(passed)).pop()
    assert f"claimed by another launch that is starting: {winner} (claimed" in results[loser], results
    assert rundir.claim_numbers(run) == [2, 1]
    assert json.loads(rundir.claim_file(run, 2).read_text())["owner"] == winner
    assert "took over from a stale holder" in said[winner][0] and said[loser] == [], said


# A SLURM batch script's first step (``launch.attempts begin``), held at a barrier: it says it is ready,
# then spins on the go file, so that both racers enter the claim within about a millisecond.
RACER = ("import os, sys, time; from launch.attempts import main; ready, go = sys.argv[1:3]; open(ready, 'w').close()\n"
         "while not os.path.exists(go): time.sleep(0.0005)\n"
         "sys.exit(main(sys.argv[3:]))")


def test_two_batch_scripts_released_together_exactly_one_passes_each_time(tmp_path):
    """The claim as ``launch.attempts begin`` makes it, in two processes (the claim's process the batch
    shell): the loser's error names the winner, attempts.jsonl has the winner's start alone, and the
    winner's end, recorded, frees the run dir at once for the next pair. No beat is written by either
    (they are still starting): only the claim tells them apart. Which order the claims ran in is left to
    chance here; the order that matters is forced above."""
    run, recipe = tmp_path / "run", str(REPO / "recipes" / "tiny.toml")
    for attempt in range(3):
        gate = tmp_path / f"try-{attempt}"
        gate.mkdir()
        jobs = [f"{attempt}0", f"{attempt}1"]
        racers = [subprocess.Popen([sys.executable, "-c", RACER, str(gate / job), str(gate / "go"), "begin", str(run),
                                    "--job", job, "--recipe", recipe], cwd=REPO, env=env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for job in jobs]
        wait_for(lambda: all((gate / job).exists() for job in jobs), "both racers at the barrier", timeout=60)
        (gate / "go").touch()
        results = [(r.wait(timeout=60), r.stderr.read()) for r in racers]
        codes = sorted(code for code, _ in results)
        assert codes == [0, Exit.BAD_INPUT], (attempt, results)
        winner = jobs[[code for code, _ in results].index(0)]
        refused = next(err for code, err in results if code)
        assert "claimed by another launch that is starting" in refused and f": {winner} (claimed" in refused, refused
        assert [e["job"] for e in rundir.read_jsonl(rundir.attempts_file(run)) if e["event"] == "start"][-1] == winner
        from launch.attempts import main as attempts_main
        assert attempts_main(["end", str(run), "--job", winner, "--rc", "0"]) == 0


def test_a_finished_multi_node_runs_dir_accepts_a_new_job_at_once(tmp_path):
    """Its last beats from another host are fresh, but its launcher recorded its end: its ranks are gone."""
    from launch.attempts import main as attempts_main

    run, recipe = tmp_path / "run", str(REPO / "recipes" / "tiny.toml")
    assert attempts_main(["begin", str(run), "--job", "77", "--recipe", recipe]) == 0
    write_beat(run, 1, pid=4242, host="node-b", launch="77/0/node-a:20077", age=0.5)  # after begin cleared them
    beat = json.loads(rundir.beat_file(run, 1).read_text()) | {"owner": "77"}
    rundir.beat_file(run, 1).write_text(json.dumps(beat))
    said = []
    assert "beating on node-b" in claim(run, LIMITS, job="78", say=said.append)  # the job still runs
    assert attempts_main(["end", str(run), "--job", "77", "--rc", "0"]) == 0
    assert claim(run, LIMITS, job="78", say=said.append) is None and said == []


def test_a_claim_from_another_host_holds_for_the_first_steps_allowance(tmp_path):
    """A launch starting on another node has claimed the run dir and written no beat yet."""
    run = tmp_path / "run"
    record = {"owner": "77", "host": "node-b", "pid": 4242, "agent": 1, "time": time.time() - 250, "process": 1.0}
    rundir.claims_dir(run).mkdir(parents=True)
    rundir.claim_file(run, 1).write_text(json.dumps(record))
    held = claim(run, LIMITS, job="78")
    assert held and "claimed by another launch that is starting: 77" in held and "node-b" in held, held
    said = []
    assert claim(run, LIMITS, job="78", now=time.time() + 100, say=said.append) is None  # 350 s > 300 s
    assert "took over from a stale holder" in said[0] and "no beat in the first step's allowance" in said[0], said
    assert json.loads(rundir.claim_file(run, 2).read_text())["owner"] == "78"


# ---- die with the parent -----------------------------------------------------------------------

RANK = ("import sys, time; sys.path.insert(0, {repo!r}); from health.holder import die_with_parent; "
        "print(die_with_parent({parent}), flush=True); time.sleep(60)")
AGENT = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); "
         "print(p.pid, flush=True); time.sleep(60)")  # as torchrun starts its workers


def agent_and_rank(torchrun: bool, parent: str = "None"):
    environment = {k: v for k, v in env().items() if k != "TORCHELASTIC_RUN_ID"}
    if torchrun:
        environment["TORCHELASTIC_RUN_ID"] = "test"
    agent = subprocess.Popen([sys.executable, "-c", AGENT.format(rank=RANK.format(repo=str(REPO), parent=parent))],
                             stdout=subprocess.PIPE, text=True, env=environment)
    return agent, int(agent.stdout.readline())


@pytest.mark.parametrize("torchrun", [True, False])
def test_a_rank_dies_with_its_agent_only_under_torchrun(torchrun):
    agent, rank = agent_and_rank(torchrun)
    try:
        assert agent.stdout.readline().strip() == str(torchrun)  # the rank is up (and set, or not)
        agent.kill()
        agent.wait()
        if torchrun:
            wait_for(lambda: not pid_alive(rank), "the rank to die with its agent", timeout=10)
        else:  # plain python train.py: its own single rank, it may outlive whoever started it
            time.sleep(1)
            assert pid_alive(rank)
    finally:
        kill_tree(agent.pid)
        if pid_alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_rank_whose_agent_died_before_it_asked_exits_at_once():
    agent, rank = agent_and_rank(True, parent="1234567")  # the agent seen first is not its parent now
    try:
        wait_for(lambda: not pid_alive(rank), "the orphan to end", timeout=10)
    finally:
        kill_tree(agent.pid)


# ---- for real: torchrun killed, a second launch refused, then the run taken over --------------------

# Long enough that ranks left behind by the kill would still be training 10 s later (~0.5 s a step on
# two ranks here: 50+ steps after the first checkpoint), short enough for one rank to finish it.
STEPS = 60
SETS = (f"training.steps={STEPS}", "training.seq_len=64", "training.global_batch=8", "training.micro_batch=4",
        "schedule.warmup_steps=2", "logging.interval=1", "checkpoint.interval=4", "logging.tensorboard=false",
        "eval.at_end=false")


def tree(run: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``run``: (size, mtime_ns). A file created or removed changes its folder's."""
    return {str(p.relative_to(run)): (p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in [run, *run.rglob("*")]}


@pytest.mark.slow
def test_a_killed_torchrun_leaves_no_rank_and_a_second_launch_waits_for_the_run_dir(tmp_path):
    run = tmp_path / "run"
    sets = ("tiny.toml", f"run.output_dir={run}", *SETS)
    holder = subprocess.Popen(train_command(*sets, nproc=2), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)  # setsid torchrun ...
    ranks = []
    try:
        wait_for(lambda: rundir.complete_steps(run), "the first complete checkpoint", timeout=480)
        ranks = wait_for(lambda: (b := read_beats(run)) and len(b) == 2 and sorted(x["pid"] for x in b),
                         "both ranks' heartbeats")
        # Freeze the holder (its ranks stay alive), so that the run dir stands still while the second
        # launch runs: any file it wrote would show.
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        before = tree(run)
        second = train(*sets, nproc=1, timeout=600)
        assert second.returncode == Exit.BAD_INPUT, second.stderr[-3000:]
        assert "is held by another launch whose ranks are alive" in second.stderr, second.stderr[-3000:]
        for pid in ranks:
            assert f"pid {pid} on {HOST}" in second.stderr, second.stderr[-3000:]
        assert "launch 001" in second.stderr and "last beat" in second.stderr, second.stderr[-3000:]
        assert tree(run) == before

        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        os.killpg(holder.pid, signal.SIGKILL)  # kill -9 -- -PGID: torchrun's group, not its ranks' sessions
        holder.wait()
        wait_for(lambda: not any(pid_alive(pid) for pid in ranks), "every rank gone with torchrun", timeout=10)
    finally:
        kill_tree(holder.pid)
        for pid in ranks:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    latest = rundir.latest_complete_step(run)
    again = train(*sets, nproc=1, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert f"Training starts at step {latest + 1}" in out, out[-3000:]
    assert "took over from a stale holder" in out and "launch 001" in out, out[-3000:]
    assert f"pids {ranks[0]}, {ranks[1]} gone from {HOST}" in out or \
        f"pids {ranks[1]}, {ranks[0]} gone from {HOST}" in out, out[-3000:]
    assert max(losses(run)) == STEPS
