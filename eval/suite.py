"""One entry point for every evaluation, used by ``eval.run`` and the trainer.

``evaluate(model_fn, tokenizer, spec)`` returns flat ``name -> float`` metrics
(``core/...``, ``lm_eval/...``, ``humaneval/...``, and with held-out sets given
``eval/val_loss_pos/...``), the same on every rank;
``run_evals`` returns the detailed results (``Report``) that ``eval.run``
prints and writes. Every rank must call them with the same spec; the
model should be in eval mode (forwards run under ``torch.no_grad``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import dist
from .core import CoreResult, evaluate_core
from .spec import EvalSpec


@dataclasses.dataclass
class Report:
    core: CoreResult | None = None
    lm_eval: dict | None = None  # lm-eval's per-task results
    humaneval: object | None = None  # eval.humaneval.HumanEvalResult
    evalplus: list | None = None  # eval.evalplus.EvalPlusResult per dataset
    loss_by_position: dict[str, float] | None = None  # eval/val_loss_pos/<start>-<end> (eval.position_loss)

    def metrics(self) -> dict[str, float]:
        out = dict(self.loss_by_position or {})
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


def run_evals(model_fn, tokenizer, spec: EvalSpec, *, max_seq_len: int, device: torch.device | str = "cpu",
              log: Callable[[str], None] | None = None, chat_template: str | None = None,
              evalplus_tasks: Sequence[list[dict]] | None = None, held_out: Sequence | None = None) -> Report:
    """Run the evaluations ``spec`` asks for (its ``val_sources`` are the trainer's): CORE, lm-eval
    tasks, HumanEval, EvalPlus. ``chat_template``: the model's, a data.chat spec, for EvalPlus's
    instruct prompts (unless the tokenizer is an export's with its own); ``evalplus_tasks``: one
    task list per ``spec.evalplus`` dataset, already loaded (else read from ``spec.evalplus_data``).
    ``held_out``: held-out sets (data.mixture.Mixture, all of one length: eval.position_loss.held_out_mixtures)
    to score the loss by position on, in ``spec.position_buckets`` buckets of their length, the first
    ``spec.val_samples`` rows of each (``eval.run --loss-by-position``; the trainer scores its own)."""
    report = Report()
    if held_out and spec.position_buckets:
        from .position_loss import bucket_edges, loss_by_position

        edges = bucket_edges(held_out[0].seq_len, spec.position_buckets)
        report.loss_by_position = loss_by_position(model_fn, held_out, spec.val_samples, edges, device)
        if log:
            log(f"loss by position ({spec.val_samples} rows of {held_out[0].seq_len} tokens a set): "
                + ", ".join(f"{k.rpartition('/')[2]} {v:.4f}" for k, v in report.loss_by_position.items()))
    if spec.core_bundle is not None:
        report.core = evaluate_core(model_fn, tokenizer, spec.core_bundle, max_seq_len=max_seq_len,
                                    max_per_task=spec.core_max_per_task, labels=spec.core_tasks, device=device,
                                    log=log)
        if log:
            log(report.core.summary())
    if spec.lm_eval_tasks is not None:
        from .lm_harness import LaneformerLM, load_task_file, run_lm_eval

        lm = LaneformerLM(model_fn, tokenizer, max_seq_len=max_seq_len, device=device)
        report.lm_eval = dist.broadcast_object(run_lm_eval(lm, load_task_file(spec.lm_eval_tasks),
                                                           limit=spec.lm_eval_limit))
    if spec.humaneval:
        from .humaneval import evaluate_humaneval

        length = {"max_new_tokens": spec.humaneval_max_new_tokens} if spec.humaneval_max_new_tokens else {}
        report.humaneval = evaluate_humaneval(model_fn, tokenizer, max_seq_len=max_seq_len, device=device,
                                              limit=spec.humaneval_limit, samples=spec.humaneval_samples,
                                              temperature=spec.humaneval_temperature, **length)
    if spec.evalplus:
        from .evalplus import evaluate_evalplus, load_tasks

        datasets = spec.evalplus_datasets
        if evalplus_tasks is None:
            evalplus_tasks = [load_tasks(d, f, spec.evalplus_limit)
                              for d, f in zip(datasets, evalplus_files(datasets, spec.evalplus_data))]
        length = {"max_new_tokens": spec.evalplus_max_new_tokens} if spec.evalplus_max_new_tokens else {}
        report.evalplus = [
            evaluate_evalplus(model_fn, tokenizer, d, max_seq_len=max_seq_len, device=device, tasks=tasks,
                              chat=spec.evalplus_chat, chat_template=chat_template,
                              find_zero=spec.evalplus_find_zero, samples=spec.evalplus_samples,
                              temperature=spec.evalplus_temperature, top_p=spec.evalplus_top_p, seed=spec.evalplus_seed,
                              **length)
            for d, tasks in zip(datasets, evalplus_tasks)]
    return report


def check_inputs(spec: EvalSpec) -> list[str]:
    """What is wrong with the files ``spec`` names (the CORE bundle's task list, the lm-eval task
    file), before any model is loaded: a CLI or a launch answers bad input at once, not after the load."""
    from .core_data import read_manifest

    problems = []
    bundle = spec.core_bundle and Path(spec.core_bundle)
    if bundle and not (bundle / "tasks.csv").is_file():
        problems.append(f"CORE bundle {bundle}: no tasks.csv{'' if bundle.is_dir() else ' (no such folder)'}; "
                        "get the bundle with python -m eval.core_data fetch DIR")
    elif bundle:  # a task file may be missing: a partial CORE is scored, the rest counted as missing
        try:
            read_manifest(bundle)
        except (ValueError, KeyError) as e:
            problems.append(f"CORE bundle {bundle}: {e}")
    if spec.lm_eval_tasks is not None:
        from .lm_harness import load_task_file

        try:
            load_task_file(spec.lm_eval_tasks)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"lm-eval tasks {spec.lm_eval_tasks}: {e}")
    return problems


def evalplus_files(datasets: list[str], spec: str | None) -> list[Path | None]:
    """The release file of each dataset: ``spec`` (EvalSpec.evalplus_data) as a folder holding the
    releases under their own names (HumanEvalPlus.jsonl(.gz), MbppPlus.jsonl(.gz)) or one file per
    dataset, comma-separated, in order; None: EvalPlus's cache or download, per dataset."""
    from .evalplus import RELEASES, EvalPlusDataError

    if spec is None:
        return [None] * len(datasets)
    if Path(spec).is_dir():
        out = []
        for d in datasets:
            names = [f"{RELEASES[d][0]}.jsonl{ext}" for ext in (".gz", "")]
            found = [Path(spec) / n for n in names if (Path(spec) / n).is_file()]
            if not found:
                raise EvalPlusDataError(f"{spec}: --evalplus-data: no {' or '.join(names)} for --evalplus {d}")
            out.append(found[0])
        return out
    files = [Path(f) for f in spec.split(",")]
    if len(files) != len(datasets):
        raise ValueError(f"--evalplus-data {spec}: {len(files)} file(s) for {len(datasets)} datasets "
                         f"({','.join(datasets)}): give one per dataset, in that order, or a folder holding them")
    return files


def evaluate(model_fn, tokenizer, spec: EvalSpec, **kwargs) -> dict[str, float]:
    """Flat metrics of ``run_evals`` (same arguments), for a trainer's logger."""
    return run_evals(model_fn, tokenizer, spec, **kwargs).metrics()
