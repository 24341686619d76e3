"""Hooks run in priority order (that they run after the step's checkpoint save is
tests/train/test_faults.py's damaged-checkpoint run)."""

from __future__ import annotations

from train import recipe as R
from train.build import trainer_config
from train.eval_hook import EvalHook
from train.export_hook import ExportHook
from train.hooks import Hook, LogSourceTokens, in_order
from train.health.preemption import PreemptionHook
from train.report_hook import ReportHook
from train.health.straggler import StragglerHook


def test_hooks_run_higher_priority_first_and_keep_the_given_order_among_equals():
    class A(Hook):
        priority = 5

    class B(Hook):
        pass

    class C(Hook):
        priority = -5

    b1, b2, a, c = B(), B(), A(), C()
    assert in_order([c, b1, a, b2]) == [a, b1, b2, c]
    Hook().after_step(None), Hook().after_train(None)  # every point exists on the base: no hasattr


def test_a_runs_hooks_log_tokens_first_and_preempt_last(tmp_path):
    recipe = R.load("tiny.toml", [f"run.output_dir={tmp_path}", "checkpoint.export_hf=true"])
    hooks = in_order([LogSourceTokens(), *(h.build() for h in trainer_config(recipe).hooks)])
    kinds = [type(h) for h in hooks]
    assert kinds == [LogSourceTokens, StragglerHook, EvalHook, ExportHook, ReportHook, PreemptionHook]
