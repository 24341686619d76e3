"""One entry point for every evaluation, used by ``eval.run`` and the trainer.

``evaluate(model_fn, tokenizer, ...)`` returns flat ``name -> float`` metrics
(``core/...``, ``lm_eval/...``, ``humaneval/...``), the same on every rank;
``run_evals`` returns the detailed results (``Report``) that ``eval.run``
prints and writes. Every rank must call them with the same arguments; the
model should be in eval mode (forwards run under ``torch.no_grad``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import dist
from .core import CoreResult, evaluate_core


@dataclasses.dataclass
class Report:
    core: CoreResult | None = None
    lm_eval: dict | None = None  # lm-eval's per-task results
    humaneval: object | None = None  # eval.humaneval.HumanEvalResult
    evalplus: list | None = None  # eval.evalplus.EvalPlusResult per dataset

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.core is not None:
            out.update(self.core.metrics())
        if self.lm_eval is not None:
            from .lm_harness import flat_metrics

            out.update(flat_metrics(self.lm_eval))
        if self.humaneval is not None:
            out.update(self.humaneval.metrics())
        for result in self.evalplus or ():
            out.update(result.metrics())
        return out


def run_evals(model_fn, tokenizer, *, max_seq_len: int, device: torch.device | str = "cpu",
              core_bundle: str | Path | None = None, max_per_task: int | None = 500, core_tasks=None,
              lm_eval_tasks: list[dict] | str | Path | None = None, limit: int | float | None = None,
              humaneval: bool = False, humaneval_limit: int | None = None, samples: int = 1,
              temperature: float = 0.0, max_new_tokens: int | None = None, log: Callable[[str], None] | None = None,
              evalplus: str | Sequence[str] | None = None, evalplus_data: str | Path | None = None,
              evalplus_limit: int | None = None, evalplus_tasks: Sequence[list[dict]] | None = None,
              evalplus_find_zero: str = "fixed", chat: bool = False, chat_template: str | None = None) -> Report:
    """Run the requested evaluations: CORE (``core_bundle``), lm-eval tasks, HumanEval,
    EvalPlus (``evalplus``: "humaneval", "mbpp" or a list of both, read from ``evalplus_data``
    (one dataset) or given as ``evalplus_tasks`` (one task list per dataset, already loaded),
    ``evalplus_find_zero`` "fixed" or "released" (eval.evalplus);
    ``chat``: its instruct prompts, through ``chat_template``, a data.chat spec, unless the
    tokenizer is an export's with its own). ``max_new_tokens`` None: each benchmark's own limit
    (HumanEval 512, EvalPlus 768, as their harnesses generate)."""
    report = Report()
    length = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}  # else each benchmark's own
    if core_bundle is not None:
        report.core = evaluate_core(model_fn, tokenizer, core_bundle, max_seq_len=max_seq_len,
                                    max_per_task=max_per_task, labels=core_tasks, device=device, log=log)
        if log:
            log(report.core.summary())
    if lm_eval_tasks is not None:
        from .lm_harness import LaneformerLM, load_task_file, run_lm_eval

        tasks = lm_eval_tasks if isinstance(lm_eval_tasks, list) else load_task_file(lm_eval_tasks)
        lm = LaneformerLM(model_fn, tokenizer, max_seq_len=max_seq_len, device=device)
        report.lm_eval = dist.broadcast_object(run_lm_eval(lm, tasks, limit=limit))
    if humaneval:
        from .humaneval import evaluate_humaneval

        report.humaneval = evaluate_humaneval(model_fn, tokenizer, max_seq_len=max_seq_len, device=device,
                                              limit=humaneval_limit, samples=samples, temperature=temperature,
                                              **length)
    if evalplus:
        from .evalplus import evaluate_evalplus

        datasets = [evalplus] if isinstance(evalplus, str) else list(evalplus)
        if evalplus_data is not None and len(datasets) > 1:
            raise ValueError(f"evalplus_data: one release file for {datasets}; pass evalplus_tasks instead")
        report.evalplus = [
            evaluate_evalplus(model_fn, tokenizer, d, max_seq_len=max_seq_len, device=device,
                              tasks=evalplus_tasks[i] if evalplus_tasks is not None else None,
                              data_path=evalplus_data, limit=evalplus_limit, chat=chat,
                              chat_template=chat_template, find_zero=evalplus_find_zero, **length)
            for i, d in enumerate(datasets)]
    return report


def evaluate(model_fn, tokenizer, **kwargs) -> dict[str, float]:
    """Flat metrics of ``run_evals`` (same keyword arguments), for a trainer's logger."""
    return run_evals(model_fn, tokenizer, **kwargs).metrics()
