"""Rewards a program checks, for RL on code (train.objectives.rl): each scored in the sandbox EvalPlus's checks
run in (eval.sandbox: no network, no writes outside its directory, time and memory limits).

- ``pass_rate``: the completion after its prompt, then each of the task's tests on its own; the reward is the
  fraction that passed. ``pass_fail``: 1 when all passed, else 0.
- ``module:function``: ``function(prompt, completion, task) -> float`` (``task``: {"id", "prompt", "tests"}),
  imported and called in the same sandbox.

A program reports only through lines that start with a nonce drawn for it (``secrets``), which the code it
runs cannot know: what a completion prints is ignored. A reward that hangs (past the time limit), crashes (no
closing line: an exception in the reward function, a killed or exited process) or reports garbage (not a
finite number) scores 0 and is counted (``Scored.failure``); it never raises into training.

The completion is cut at the first of HumanEval's stop strings (``STOPS``, as eval.generate cuts), so what
follows the function's body is not run.
"""

from __future__ import annotations

import importlib
import json
import math
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rundir import REPO

from .generate import cut_at_stop
from .sandbox import run_program

STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")  # HumanEval's, and a test's start
FAILURES = ("timeout", "crash", "garbage")


@dataclass(frozen=True)
class Scored:
    reward: float
    failure: str = ""  # "" or one of FAILURES: then reward is 0


def completion_code(text: str) -> str:
    """The completion as run: cut at the first stop string."""
    return cut_at_stop(text, STOPS)[0]


def code_program(prompt: str, completion: str, tests: list[str], nonce: str) -> str:
    """The prompt and completion, then each test, each passed test reported as ``<nonce> pass <i>``."""
    return f"""
_nonce = {nonce!r}
try:
    exec(compile({(prompt + completion_code(completion))!r}, "completion.py", "exec"), globals())
except BaseException:
    pass
for _i, _test in enumerate({list(tests)!r}):
    try:
        exec(compile(_test, "test.py", "exec"), globals())
        print(_nonce, "pass", _i, flush=True)
    except BaseException:
        pass
print(_nonce, "done", flush=True)
"""


def function_program(spec: str, prompt: str, completion: str, task: dict[str, Any], nonce: str) -> str:
    module, function = spec.split(":")
    return f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from {module} import {function} as _reward
import json
_value = _reward({prompt!r}, {completion!r}, json.loads({json.dumps(task)!r}))
print({nonce!r}, "reward", repr(float(_value)), flush=True)
"""


def _lines(stdout: str, nonce: str) -> list[list[str]]:
    return [line.split()[1:] for line in stdout.splitlines() if line.startswith(nonce + " ")]


def score(reward: str, prompt: str, completion: str, task: dict[str, Any], timeout_s: float = 2.0,
          memory_mb: int = 1024) -> Scored:
    """One completion's reward (the module's docstring); never raises."""
    nonce = secrets.token_hex(16)
    try:
        if reward in ("pass_rate", "pass_fail"):
            result = run_program(code_program(prompt, completion, task["tests"], nonce), timeout_s=timeout_s,
                                 memory_mb=memory_mb)
        else:
            result = run_program(function_program(reward, prompt, completion, task, nonce), timeout_s=timeout_s,
                                 memory_mb=memory_mb)
    except Exception:  # the sandbox itself failed to run it
        return Scored(0.0, "crash")
    if result.status == "timeout":
        return Scored(0.0, "timeout")
    lines = _lines(result.stdout_tail, nonce)
    if reward in ("pass_rate", "pass_fail"):
        if ["done"] not in lines:
            return Scored(0.0, "crash")
        passed = {int(w[1]) for w in lines if len(w) == 2 and w[0] == "pass" and w[1].isdigit()}
        rate = len(passed & set(range(len(task["tests"])))) / len(task["tests"])
        return Scored(rate if reward == "pass_rate" else float(rate == 1.0))
    values = [w[1] for w in lines if len(w) == 2 and w[0] == "reward"]
    if not values:
        return Scored(0.0, "crash")
    try:
        value = float(values[-1])
    except ValueError:
        return Scored(0.0, "garbage")
    return Scored(value) if math.isfinite(value) else Scored(0.0, "garbage")


def score_all(reward: str, jobs: list[tuple[str, str, dict[str, Any]]], timeout_s: float = 2.0,
              memory_mb: int = 1024, workers: int = 4) -> list[Scored]:
    """``score`` of each (prompt, completion, task), in order, ``workers`` sandboxes at a time."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda job: score(reward, *job, timeout_s=timeout_s, memory_mb=memory_mb), jobs))


def check_reward(reward: str) -> str | None:
    """Why a ``module:function`` reward cannot be used here (its module does not import, or has no such
    function), else None."""
    if reward in ("pass_rate", "pass_fail"):
        return None
    module, function = reward.split(":")
    try:
        found = getattr(importlib.import_module(module), function, None)
    except Exception as e:
        return f"{module} does not import ({type(e).__name__}: {e})"
    return None if callable(found) else f"{module} has no function {function!r}"
