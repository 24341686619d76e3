"""Run untrusted Python (model-written programs) in a limited subprocess.

Each program runs in a fresh temporary directory, in its own session (so the
whole process group can be killed), under ``python -I`` with:
- a wall-time limit, enforced by the parent (SIGKILL to the process group),
  and RLIMIT_CPU one second above it as a backstop;
- RLIMIT_AS (memory), RLIMIT_FSIZE (file size) and no core dumps, set by a
  guard that runs in the child before the program;
- no network: the guard replaces ``socket.socket`` (and ``_socket.socket``,
  ``create_connection``, ``getaddrinfo``...) with versions that raise, and
  where ``unshare`` works the child also gets an empty network namespace (no
  interface, not even loopback), which a program cannot undo;
- where ``unshare --pid`` works, its own PID namespace: when the program ends
  or is killed, every process it started dies with it, even one that left
  the process group with setsid.
Output goes to files, not pipes, so a grandchild holding them open cannot
block the parent. This is isolation against accidents and careless code, not
a security boundary against a determined attacker (no seccomp or chroot).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GUARD = r"""
import resource, socket, _socket, sys
def limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
limit(resource.RLIMIT_AS, {memory})
limit(resource.RLIMIT_CPU, {cpu})
limit(resource.RLIMIT_FSIZE, {fsize})
limit(resource.RLIMIT_CORE, 0)
def refuse(*args, **kwargs):
    raise PermissionError("network access is disabled in the sandbox")
class NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")
socket.socket = _socket.socket = NoSocket
for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo", "gethostbyname"):
    setattr(socket, name, refuse)
sys.argv = ["program.py"]
with open("program.py") as f:
    code = compile(f.read(), "program.py", "exec")
exec(code, {{"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}})
"""


@dataclasses.dataclass
class ExecResult:
    status: str  # "passed", "failed" or "timeout"
    returncode: int | None
    seconds: float
    stderr_tail: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """The strongest ``unshare`` command line that works here (new network and PID namespaces), or ()."""
    pid = ("--pid", "--fork", "--kill-child")
    for prefix in (("unshare", "--net", *pid), ("unshare", "--net", "--map-root-user", *pid),
                   ("unshare", "--net"), ("unshare", "--net", "--map-root-user")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


def run_program(program: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, fsize_mb: int = 16) -> ExecResult:
    """Run ``program``; "passed" means it exited 0 within ``timeout_s`` seconds."""
    guard = GUARD.format(memory=memory_mb << 20, cpu=int(timeout_s) + 1, fsize=fsize_mb << 20)
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp:
        Path(tmp, "program.py").write_text(program)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "LANG": "C.UTF-8"}
        cmd = [*namespace_prefix(), sys.executable, "-I", "-B", "-c", guard]
        t0 = time.monotonic()
        with open(Path(tmp, "stdout"), "wb") as out, open(Path(tmp, "stderr"), "wb") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout_s)
                status = "passed" if returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                returncode, status = None, "timeout"
            finally:
                _kill_group(proc.pid)
                proc.wait()
        seconds = time.monotonic() - t0
        stderr = Path(tmp, "stderr").read_bytes()[-2000:].decode("utf-8", "replace")
    return ExecResult(status, returncode, seconds, stderr)


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the program's process group (it may have forked)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
