"""``module:function`` rewards for the RL tests (eval.rewards): a good one, and one that crashes, hangs or
reports garbage."""

from __future__ import annotations

import time


def digits(prompt: str, completion: str, task: dict) -> float:
    """The fraction of the completion's characters that are digits: a reward a random tiny model varies on."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def crash(prompt: str, completion: str, task: dict) -> float:
    raise RuntimeError("this reward crashes")


def hang(prompt: str, completion: str, task: dict) -> float:
    while True:
        time.sleep(1)


def garbage(prompt: str, completion: str, task: dict) -> float:
    print("1.0")  # printed, not returned: ignored
    return float("nan")


def text(prompt: str, completion: str, task: dict):
    return "lots"
