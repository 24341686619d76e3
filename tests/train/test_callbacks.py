"""The step's lifecycle (train.callbacks): the order of the points and of the callbacks at each, as the
README's "One step, in order" table says and as one real step of a pretraining and of a preference run
runs; a callback's phase is declared, not derived from its class name; a beat shows a new phase at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from data.tokenizer import TINY_TOKENIZER
from launch.watchdog import Limits, allowance, stalled
from models.laneformer.hf.export import export_hf
from rundir import REPO
from tests.conftest import env, short, tiny_random_model
from tests.train.pair_sources import write_pair_source
from train import recipe as R
from train.build import callbacks as callback_configs
from train.callbacks.callback import POINTS, Callback, Callbacks
from train.callbacks.eval import Eval
from health.heartbeat import Heartbeat, read_beats
from health.phases import Phase, bucket

TABLE_MARK = "<!-- one-step-table:"
REFERENCE_PASS = "trainer: the objective's `prepare` (a preference run's reference pass)"  # the table's row a pretraining run has not


def readme_table() -> list[tuple[str, str, str, str]]:
    """(point, callback, phase, priority) of each row of the README's table; point '' for the trainer's own."""
    text = (REPO / "README.md").read_text()
    lines = text[text.index(TABLE_MARK):].splitlines()[3:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        point, callback, phase, priority = (c.strip().strip("`") for c in line.strip("|").split("|")[:4])
        rows.append(("" if point == "—" else point, callback, phase, priority))
    return rows


def expected_sequence(rows) -> list:
    """The README's rows as a sequence: ("point", name, [callbacks]) per point, ("phase", p) per trainer row."""
    seq = []
    for point, callback, phase, _ in rows:
        if not point:
            seq.append(("phase", phase))
        elif seq and seq[-1][0] == "point" and seq[-1][1] == point:
            seq[-1][2].append(callback)
        else:
            seq.append(("point", point, [callback]))
    return seq


def every_callback_class(monkeypatch, tmp_path) -> list[type]:
    monkeypatch.setenv("LANEFORMER_TEST_BITFLIP", "0:1")  # the test-only one too
    recipe = R.load("tiny.toml", [f"run.output_dir={tmp_path}", "checkpoint.export_hf=true", "logging.report=true"])
    preference = R.load("tiny-dpo.toml", [f"run.output_dir={tmp_path}"])  # a preference run's callbacks too
    return list(dict.fromkeys(c._owner for r in (recipe, preference) for c in callback_configs(r)))


class Named(Callback):
    def __init__(self, name, priority, phase=Phase.METRICS):
        self.name, self.priority, self.phase = name, priority, phase

    def post_step(self, trainer):
        trainer.append(self.name)


def test_callbacks_run_by_priority_then_name_and_share_no_name():
    calls, phases = [], []
    callbacks = Callbacks([Named("b", 0), Named("a", 0), Named("z", 5), Named("c", -5)], phases.append)
    callbacks.call("post_step", calls)
    assert calls == ["z", "a", "b", "c"]  # higher priority first; equals by name, whatever the given order
    assert [c.name for c in callbacks.at("post_train")] == []  # only callbacks overriding a point act at it
    with pytest.raises(ValueError, match="share a name"):
        Callbacks([Named("a", 0), Named("a", 1)], phases.append)
    for point in POINTS:  # every point exists on the base
        assert callable(getattr(Callback, point))


def test_the_readme_table_lists_every_callback_at_each_point_in_calling_order(monkeypatch, tmp_path):
    classes = every_callback_class(monkeypatch, tmp_path)
    table = readme_table()
    for point in POINTS:
        acting = sorted((k for k in classes if getattr(k, point) is not getattr(Callback, point)),
                        key=lambda k: (-k.priority, k.name))
        rows = [(c, ph, pr) for p, c, ph, pr in table if p == point]
        assert rows == [(k.name, k.phase.value, str(k.priority)) for k in acting], point
    assert [r[0] for r in table if r[0]] == sorted((r[0] for r in table if r[0]), key=POINTS.index)


def test_a_callback_renamed_by_subclassing_keeps_its_phase_allowance_and_bucket(tmp_path):
    """A class's name decides nothing: its declared phase does (before, EvalHook -> "eval" came from the name)."""

    class Quiz(Eval):  # another class name, the same callback
        def __init__(self):
            pass

        def post_step(self, trainer):
            pass

    heartbeat = Heartbeat(tmp_path)
    heartbeat.mark("first_step")
    heartbeat.step_done()
    Callbacks([Quiz()], lambda phase: heartbeat.beat(phase, 7)).call("post_step", None)
    (beat,) = read_beats(tmp_path)
    assert Quiz.phase is Phase.EVAL and beat["phase"] == "eval"
    limits = Limits(stall=10, first_step=100, checkpoint=200, eval=300)
    assert allowance([beat], limits) == (300, "eval")  # the eval allowance, not the steady one
    assert bucket(beat["phase"]) == "evals"  # booked as evals in goodput, not productive time
    assert (Phase.ROLLBACK.allowance, Phase.ROLLBACK.bucket) == ("checkpoint", "rollbacks")


def test_a_rank_that_blocks_right_after_a_phase_change_is_seen_in_the_new_phase(tmp_path):
    heartbeat = Heartbeat(tmp_path)
    heartbeat.mark("first_step")
    heartbeat.step_done()
    heartbeat.beat(Phase.DATA, 5)
    heartbeat.beat(Phase.FORWARD_BACKWARD, 5)  # within a second of the last write, the same allowance
    assert [(b["phase"], b["step"]) for b in read_beats(tmp_path)] == [("forward_backward", 5)]
    heartbeat.beat(Phase.DATA, 6)  # a new step
    assert [(b["phase"], b["step"]) for b in read_beats(tmp_path)] == [("data", 6)]
    stall = stalled(read_beats(tmp_path), time.time() - 100, Limits(stall=10, first_step=10, checkpoint=20, eval=10),
                    time.time() + 11)
    assert (stall["ranks"][0]["phase"], stall["ranks"][0]["step"]) == ("data", 6)  # what stall.json says
    heartbeat.beat(Phase.CHECKPOINT, 6)
    heartbeat.beat(Phase.CHECKPOINT, 6)  # the same phase and step: this one may wait for the next second
    (beat,) = read_beats(tmp_path)
    assert (beat["phase"], beat["step"]) == ("checkpoint", 6)
    stall = stalled([beat], beat["time"] - 100, Limits(stall=10, first_step=10, checkpoint=20, eval=10),
                    beat["time"] + 21)
    assert stall["allowance"] == "checkpoint" and stall["ranks"][0]["phase"] == "checkpoint"
    assert stall["ranks"][0]["step"] == 6


TRACE = """
import json, runpy, sys
sys.path.insert(0, {repo!r})
from train.titan import use_cpu_if_no_gpu
use_cpu_if_no_gpu()
from train.callbacks.callback import Callbacks
from train.trainer import LaneformerTrainer
trace, depth = open({trace!r}, "a"), [0]
call, enter = Callbacks.call, LaneformerTrainer.enter
def traced_call(self, point, trainer, *args, then=None):
    trace.write(json.dumps({{"step": trainer.step, "point": point, "callbacks": [c.name for c in self.at(point)]}}) + "\\n")
    depth[0] += 1
    try:
        return call(self, point, trainer, *args, then=then)
    finally:
        depth[0] -= 1
def traced_enter(self, phase):
    if not depth[0]:  # the trainer's own phases (a callback's are its point's)
        trace.write(json.dumps({{"step": self.step, "phase": str(phase)}}) + "\\n")
    enter(self, phase)
Callbacks.call, LaneformerTrainer.enter = traced_call, traced_enter
sys.argv = ["train.py", *{args!r}]
runpy.run_path("train.py", run_name="__main__")
"""


def traced_step(tmp_path, recipe: str, *sets: str) -> list:
    """Step 2 of a 2-step run that logs, evaluates, saves and ends with an export and a report, so every
    row acts: the points and the trainer's own phases in the order they ran, with those before the first
    step (step 0) and after the last."""
    trace = tmp_path / "trace.jsonl"
    args = ["--recipe", recipe]
    for s in short(tmp_path, 2, "checkpoint.interval=2", "eval.every=2", "checkpoint.export_hf=true",
                   "logging.report=true", 'logging.wandb_mode="disabled"', "logging.tensorboard=false", *sets):
        args += ["--set", s]
    result = subprocess.run([sys.executable, "-c", TRACE.format(repo=str(REPO), trace=str(trace), args=args)],
                            cwd=REPO, env={**env(), "LANEFORMER_TEST_BITFLIP": "0:99"},  # present, never due
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seq = []
    for e in map(json.loads, trace.read_text().splitlines()):
        event = ("phase", e["phase"]) if "phase" in e else ("point", e["point"], e["callbacks"])
        if e["step"] in (0, 2) and (not seq or event != seq[-1] or event[0] == "point"):  # a phase beaten again: one
            seq.append(event)
    return seq


@pytest.mark.slow
def test_one_step_of_a_pretraining_run_runs_in_the_order_of_the_readme_table(tmp_path):
    table = [r for r in readme_table() if r[0] != "on_error" and r[1] != REFERENCE_PASS]
    assert traced_step(tmp_path, "tiny.toml", "eval.val_samples=8") == expected_sequence(table)


@pytest.mark.slow
def test_one_step_of_a_preference_run_runs_in_the_order_of_the_readme_table(tmp_path):
    """The reference pass comes after the load, before ``pre_train``; the held-out pairs are scored at
    ``pre_train`` (the baseline) and with the step's evals."""
    model = tiny_random_model(seed=4)
    export_hf(model.state_dict(), model.config, tmp_path / "base", tokenizer_dir=TINY_TOKENIZER.parent)
    train = write_pair_source(tmp_path / "train", 8)
    held_out = write_pair_source(tmp_path / "held_out", 4, seed=1, shards=1)
    sets = (f'data.sources=[{{name = "pairs", path = "{train}", pairs = true, weight = 1.0, max_epochs = 100}}]',
            f'preference.held_out=["{held_out}"]', f"checkpoint.init_from={tmp_path / 'base'}",
            "schedule.warmup_steps=1", "schedule.decay_fraction=0.5")
    table = [r for r in readme_table() if r[0] != "on_error"]
    assert traced_step(tmp_path, "tiny-dpo.toml", *sets) == expected_sequence(table)
