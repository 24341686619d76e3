"""The step guard's spike rule, decided on tensors, against the rule written out on the host."""

from __future__ import annotations

import math
import random

import pytest
import torch

from health.guard import StepGuard


def reference(values: list[tuple[float, float]], sigmas: float, window: int) -> list[str | None]:
    """OLMo-core's rule from its definition: non-finite, or above mean + sigmas * sample std of the
    last ``window`` finite (loss, grad norm) pairs once there are that many; every finite pair
    joins the window, skipped or not."""
    history, out = [], []
    for loss, norm in values:
        reason = None
        for name, v in (("loss", loss), ("grad norm", norm)):
            if reason is None and not math.isfinite(v):
                reason = f"non-finite {name}"
        if reason is None and len(history) >= window:
            for i, name in enumerate(("loss", "grad norm")):
                past = [h[i] for h in history[-window:]]
                mean = sum(past) / window
                std = math.sqrt(sum((p - mean) ** 2 for p in past) / (window - 1))
                if reason is None and (loss, norm)[i] > mean + sigmas * max(std, 1e-6 * abs(mean)):
                    reason = f"{name} spike"
        if math.isfinite(loss) and math.isfinite(norm):
            history.append((loss, norm))
        out.append(reason)
    return out


def run(guard: StepGuard, values) -> list[float]:
    return [float(guard.check(torch.tensor(loss), torch.tensor(norm))) for loss, norm in values]


def noisy(n, seed=0, loss=3.0, norm=1.0):
    rng = random.Random(seed)
    return [(loss + rng.gauss(0, 0.05), norm + rng.gauss(0, 0.1)) for _ in range(n)]


def test_the_spike_rule_matches_its_definition():
    values = noisy(60)
    values[5] = (float("nan"), 1.0)  # before the window is full: only non-finite values skip
    values[8] = (9.0, 1.0)  # a spike, but the window is not full yet: applied
    values[25] = (3.0, float("inf"))
    values[30] = (4.0, 1.0)  # loss spike
    values[31] = (3.0, 9.0)  # grad-norm spike
    values[41] = (3.1, 1.0)  # within 6 sigma
    expected = reference(values, sigmas=6.0, window=16)
    assert [i for i, r in enumerate(expected) if r] == [5, 25, 30, 31]
    guard = StepGuard(6.0, 16)
    got = run(guard, values)
    assert got == [float(r is not None) for r in expected]
    reading = guard.read()
    assert reading.skipped == sum(r is not None for r in expected)
    assert reading.last_step == max(i + 1 for i, r in enumerate(expected) if r)


@pytest.mark.parametrize("step, why", [(5, "non-finite loss (nan)"), (25, "non-finite grad norm (inf)")])
def test_the_reading_names_the_last_skipped_step_and_its_reason(step, why):
    values = noisy(step)
    values[step - 1] = (float("nan"), 1.0) if "loss" in why else (3.0, float("inf"))
    guard = StepGuard(6.0, 16)
    run(guard, values)
    reading = guard.read()
    assert (reading.last_step, reading.last_reason, reading.skipped, reading.consecutive) == (step, why, 1, 1)


def test_a_spike_reason_states_the_numbers():
    values = [(3.0 + 0.01 * (i % 2), 1.0) for i in range(8)] + [(5.0, 1.0)]
    guard = StepGuard(6.0, 8)
    run(guard, values)
    reason = guard.read().last_reason
    assert reason.startswith("loss spike (5 > mean 3.005 + 6.0 sigma 0.00535)"), reason


def test_a_lasting_shift_in_level_is_accepted_after_a_while():
    values = noisy(20) + noisy(40, seed=1, loss=6.0)
    expected = reference(values, 6.0, 10)
    got = run(StepGuard(6.0, 10), values)
    assert got == [float(r is not None) for r in expected]
    assert got[20] == 1.0 and got[-1] == 0.0  # skipped at first, then the new level is the norm


def test_consecutive_skips_count_and_reset():
    guard = StepGuard(6.0, 4)
    values = noisy(3) + [(float("nan"), 1.0)] * 5
    run(guard, values)
    assert guard.read().consecutive == 5
    run(guard, noisy(1))
    assert (guard.read().consecutive, guard.read().skipped) == (0, 5)


def test_disabled_guard_never_skips():
    assert run(StepGuard(6.0, 4, enabled=False), [(float("nan"), 1.0), (3.0, float("inf"))]) == [0.0, 0.0]


def test_a_restored_guard_decides_as_the_uninterrupted_one():
    values = noisy(50, seed=3)
    values[30], values[44] = (3.4, 1.0), (float("nan"), 1.0)
    whole = StepGuard(6.0, 12)
    expected = run(whole, values)
    first = StepGuard(6.0, 12)
    run(first, values[:25])
    resumed = StepGuard(6.0, 12)
    resumed.load_state_dict(first.state_dict(), step=25)
    assert run(resumed, values[25:]) == expected[25:]
    assert resumed.read() == whole.read()
    assert resumed.state_dict() == whole.state_dict()


def test_a_checkpoint_of_the_host_guard_loads():
    """The guard's earlier, host-side checkpoints: a JSON history and the skip count."""
    old = {"history": "[[3.0, 1.0], [3.1, 1.1]]", "skipped": 2}
    guard = StepGuard(6.0, 4)
    guard.load_state_dict(old, step=7)
    assert guard.state_dict() == {**old, "consecutive": 0}
    run(guard, [(float("nan"), 1.0)])
    assert guard.read().last_step == 8
