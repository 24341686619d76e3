"""The end of a run, damaged checkpoints and runaway skipping, on one rank: nothing is lost,
every stop says why and what to run next."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import torch

import rundir
from models.laneformer.state_dict_adapter import hf_to_native_name
from health.exits import EXIT_FILE_ENV, Exit
from rundir import REPO
from tests.conftest import env, losses, metrics

SHORT = ("training.seq_len=64", "training.global_batch=8", "training.micro_batch=4", "schedule.warmup_steps=2",
         "logging.interval=1", "logging.tensorboard=false", 'logging.wandb_mode="disabled"',
         "run.deterministic=true", "checkpoint.keep_last=10")

# train.py run as rank 0 of 1 without torchrun, so its own exit status comes back; an
# optional injection (exec'd first) breaks one thing on purpose.
RUN = """
import runpy, sys
sys.path.insert(0, {repo!r})
exec({inject!r})
sys.argv = ["train.py", *{args!r}]
runpy.run_path("train.py", run_name="__main__")
"""


def train_rank0(run, *sets, inject: str = "", exit_file=None) -> subprocess.CompletedProcess:
    args = ["--recipe", "tiny.toml", "--set", f"run.output_dir={run}"]
    for s in (*SHORT, *sets):
        args += ["--set", s]
    extra = {}  # train.py runs as torchrun's one rank by itself
    if exit_file:
        extra[EXIT_FILE_ENV] = str(exit_file)
    return subprocess.run([sys.executable, "-c", RUN.format(repo=str(REPO), inject=inject, args=args)],
                          cwd=REPO, env={**env(), **extra}, capture_output=True, text=True, timeout=600)


def weights(step_dir):
    from models.laneformer import read_native_config
    from models.laneformer.hf.checkpoint_io import load_dcp

    return load_dcp(step_dir, read_native_config(step_dir.parent.parent / rundir.MODEL_CONFIG_FILE))


# ---- the end of a run cannot lose it -------------------------------------------------------

FAIL_EXPORT = """
import models.laneformer.hf.export as export
def to_hf(*args, **kwargs):
    raise OSError("No space left on device")
export.to_hf = to_hf
"""


def test_a_failed_export_keeps_the_final_checkpoint_exits_3_and_says_how_to_retry(tmp_path):
    run, note = tmp_path / "run", tmp_path / "exit.json"
    result = train_rank0(run, "training.steps=3", "checkpoint.interval=100", "checkpoint.export_hf=true",
                         inject=FAIL_EXPORT, exit_file=note)
    assert result.returncode == Exit.EXPORT_FAILED, result.stderr[-3000:]
    assert rundir.latest_complete_step(run) == 3  # the final save happened before the export
    record = json.loads(note.read_text())
    assert record["code"] == 3 and record["reason"] == "training complete, export failed"
    assert "No space left on device" in record["message"]
    command = record["command"]
    assert command.startswith(f"python -m models.laneformer.convert to-hf {run} {run / 'hf'} ")
    assert command in result.stderr  # printed for the person at the terminal too

    # The command does what the export would have done, from the final checkpoint: its arguments, given to
    # the module it names in this process (what ``python -m`` would run; a process start costs seconds here).
    from models.laneformer import convert

    python, dash_m, module, *args = shlex.split(command)
    assert (python, dash_m, module) == ("python", "-m", convert.__name__)
    convert.main(args)
    from safetensors.torch import load_file

    exported = {}
    for f in (run / "hf").glob("*.safetensors"):
        exported.update(load_file(f))
    final = weights(rundir.step_dir(run, 3))  # fp32; the export is the recipe's bf16
    assert sorted(map(hf_to_native_name, exported)) == sorted(final)
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, final[hf_to_native_name(name)].bfloat16()), name
    assert "tokens seen: 1,536" in (run / "hf" / "README.md").read_text()  # 3 steps x 8 x 64


# ---- runaway skipping --------------------------------------------------------------------

ALL_NAN_FROM = """
from torchtitan.components.loss import CrossEntropyLoss
calls = {{"n": 0}}
forward = CrossEntropyLoss.__call__
def poisoned(self, pred, *args, **kwargs):
    calls["n"] += 1
    if calls["n"] > {first_bad_call}:  # every micro-batch from here on is NaN
        pred = pred * float("nan")
    return forward(self, pred, *args, **kwargs)
CrossEntropyLoss.__call__ = poisoned
"""


def test_runaway_skipping_stops_with_exit_4_naming_the_last_checkpoint(tmp_path):
    run, note = tmp_path / "run", tmp_path / "exit.json"
    # Two micro-batches per step: steps 1-2 are fine, every step from 3 on is NaN.
    result = train_rank0(run, "training.steps=30", "checkpoint.interval=2", "training.max_consecutive_skips=3",
                         inject=ALL_NAN_FROM.format(first_bad_call=4), exit_file=note)
    assert result.returncode == Exit.SKIPPED_OUT, result.stderr[-3000:]
    record = json.loads(note.read_text())
    assert record["reason"] == "too many consecutive skipped steps" and record["step"] == 5
    last = rundir.latest_complete_checkpoint(run)
    assert last == rundir.step_dir(run, 4) and record["checkpoint"] == str(last)
    assert "3 consecutive steps skipped up to step 5" in result.stderr and str(last) in result.stderr
    assert metrics(run)[5]["skipped_steps"] == 3
    # The report is drawn once more on the way out (the report callback's on_error): its last numbers.
    assert "skipped" in (rundir.report_dir(run) / rundir.REPORT_PAGE).read_text()
    # Skipped steps left the weights as the last applied step (2) made them.
    w2, w4 = weights(rundir.step_dir(run, 2)), weights(last)
    assert all(torch.equal(w2[k], w4[k]) for k in w2)


# ---- damaged checkpoints -------------------------------------------------------------------


def truncate(step_dir):
    for f in step_dir.glob("*.distcp"):
        os.truncate(f, f.stat().st_size // 2)


# Each eval callback call records whether its step's checkpoint was complete at that moment.
RECORD_EVALS = """
import json, rundir
from train.callbacks.eval import Eval
def post_step(self, trainer, _orig=Eval.post_step):
    done = rundir.is_complete(rundir.step_dir(trainer.config.dump_folder, trainer.step))
    with open({log!r}, "a") as f:
        f.write(json.dumps([trainer.step, done]) + "\\n")
    _orig(self, trainer)
Eval.post_step = post_step
"""


def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_run_replays_from_the_previous(tmp_path):
    run, log = tmp_path / "run", tmp_path / "evals.jsonl"
    common = ("checkpoint.interval=2",)
    first_run = train_rank0(run, "training.steps=4", *common, "eval.every=2", "eval.val_samples=8",
                            inject=RECORD_EVALS.format(log=str(log)))
    assert first_run.returncode == 0, first_run.stderr[-3000:]
    # the hooks run after the step's checkpoint save: an eval at step N sees step N on disk
    assert [json.loads(line) for line in log.read_text().splitlines()] == [[1, False], [2, True], [3, False],
                                                                          [4, True]]
    assert sorted(p.name for p in (run / rundir.EVALS_DIR).iterdir()) == ["step-2.json", "step-4.json"]
    first = losses(run)
    truncate(rundir.step_dir(run, 4))

    result = train_rank0(run, "training.steps=6", *common)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert f"DAMAGED CHECKPOINT {rundir.step_dir(run, 4)} could not be loaded" in out
    assert (rundir.checkpoints_dir(run) / "step-4.damaged").is_dir()
    assert "Training starts at step 3" in out
    again = losses(run)
    assert {s: again[s] for s in (3, 4)} == {s: first[s] for s in (3, 4)}  # exact replay
    assert rundir.complete_steps(run) == [2, 4, 6]

    *earlier, last = rundir.complete_steps(run)
    for step in earlier:
        truncate(rundir.step_dir(run, step))
    metadata = rundir.step_dir(run, last) / ".metadata"  # a torn .metadata, not only torn shards
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    result = train_rank0(run, "training.steps=8", *common)
    assert result.returncode != 0
    assert "no complete checkpoint is left" in result.stderr and "not starting from scratch" in result.stderr
    assert rundir.complete_steps(run) == []
    assert sorted(p.name for p in rundir.checkpoints_dir(run).iterdir()) == [
        "step-2.damaged", "step-4.damaged", "step-4.damaged-2", "step-6.damaged"]
    # The launcher's next restart must not train from step 0 beside them either.
    result = train_rank0(run, "training.steps=8", *common)
    assert result.returncode != 0 and "holds only damaged checkpoints" in result.stderr, result.stderr[-3000:]
    assert "Training starts at step 1" not in result.stdout + result.stderr


# A checkpoint written before callbacks (round 4) kept the spike guard's state under its own key
# "guard" and had no "callbacks"; the trainer's state then is written that way here, and the next
# launch, with today's layout, must load it (not move it aside as damaged) and go on counting skips.
ROUND_4_LAYOUT = ALL_NAN_FROM.replace("> {first_bad_call}", "== 5").format() + """
from train.callbacks.spike_guard import SpikeGuard
from train.trainer import LaneformerTrainer
def round_4_state(self):
    return {"step": self.step, "ntokens_seen": self.ntokens_seen,
            "guard": self.callbacks.get(SpikeGuard.name).guard.state_dict()}
LaneformerTrainer.state_dict = round_4_state
"""


def test_a_checkpoint_from_before_callbacks_resumes_with_its_guard(tmp_path):
    run = tmp_path / "run"
    first = train_rank0(run, "training.steps=4", "checkpoint.interval=2", inject=ROUND_4_LAYOUT)
    assert first.returncode == 0, first.stderr[-3000:]
    assert metrics(run)[4]["skipped_steps"] == 1  # step 3's first micro batch (call 5) was NaN
    result = train_rank0(run, "training.steps=6", "checkpoint.interval=2")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Training starts at step 5" in out and "DAMAGED" not in out
    assert metrics(run)[6]["skipped_steps"] == 1  # the restored guard's count, not a fresh 0
    assert sorted(p.name for p in rundir.checkpoints_dir(run).iterdir()) == ["step-2", "step-4", "step-6"]
