"""Evaluate a checkpoint from the command line; prints a table and writes JSON.

    python -m eval.run --checkpoint <run dir | step dir | HF dir> [--flavor F --set k=v ...]
        [--core BUNDLE --max-per-task N [--core-tasks a,b]]
        [--lm-eval TASKS.json|yaml|NAME,NAME --limit N]
        [--humaneval --limit N --samples K --temperature T --max-new-tokens M]
        [--evalplus humaneval,mbpp [--evalplus-data FOLDER | FILE,FILE] [--chat] [--limit N]
         [--evalplus-find-zero fixed|released] [--samples N --temperature T [--top-p P] [--seed S]]
         [--evalplus-out DIR]]
        [--loss-by-position N --held-out [NAME=]DIR[,[NAME=]DIR] [--seq-len L] [--val-samples S]]
        [--tokenizer PATH] [--out results.json]

At least one of --core, --lm-eval, --humaneval, --evalplus, --loss-by-position. The tokenizer is
the checkpoint's own (models.laneformer.checkpoint.Checkpoint.open_tokenizer), never a default.

--loss-by-position N: the held-out loss by position in the document that the training loop logs
(``[eval] position_buckets``), ``eval/val_loss_pos/<start>-<end>`` in N buckets of L tokens
(default: the checkpoint's max_seq_len; edges i x L // N, as in the loop), on the first S rows of L tokens of each --held-out set
(eval.position_loss): a source split by data.held_out or a tokenized folder, named as the run names
it so that its rows are the run's.

Under ``torchrun`` each rank loads the whole model and scores its share
(gloo on CPU, NCCL on GPU); rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import torch

from . import dist
from .load import load_checkpoint
from .spec import EvalSpec, EvalSpecError, default
from .suite import Report, check_inputs, evalplus_files, run_evals

TASK_FLAGS = "--core/--lm-eval/--humaneval/--evalplus/--loss-by-position"


def table(metrics: dict[str, float]) -> str:
    width = max((len(k) for k in metrics), default=0)
    return "\n".join(f"{k:<{width}}  {v:.4f}" for k, v in metrics.items())


def report_json(report: Report, source: str, args: argparse.Namespace) -> dict:
    out = {"checkpoint": source, "args": vars(args), "metrics": report.metrics()}
    if report.core is not None:
        out["core"] = {
            "summary": report.core.summary(),
            "missing": report.core.missing,
            "tasks": {k: dataclasses.asdict(v) for k, v in report.core.tasks.items()},
        }
    if report.lm_eval is not None:
        out["lm_eval"] = report.lm_eval
    if report.humaneval is not None:
        out["humaneval"] = dataclasses.asdict(report.humaneval)
    if report.evalplus is not None:  # task ids name their dataset ("HumanEval/0", "Mbpp/2"): one table each
        samples = {k: v for r in report.evalplus for k, v in r.samples.items()}  # task -> its answers, in order
        out["evalplus"] = {"datasets": [r.dataset for r in report.evalplus], "chat": args.chat,
                           "passed": {k: v for r in report.evalplus for k, v in r.passed.items()},
                           "solutions": {k: [s.solution for s in v] for k, v in samples.items()},
                           "raw": {k: [s.raw for s in v] for k, v in samples.items()}}
    return out


def evalplus_datasets(value: str) -> list[str]:
    """``--evalplus humaneval,mbpp`` -> ["humaneval", "mbpp"], checked by EvalSpec (argparse type: a bad
    name is a usage error)."""
    try:
        return EvalSpec(evalplus=value).evalplus_datasets
    except EvalSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Each EvalSpec field and the flag that sets it (``--limit``, ``--samples`` ... serve every benchmark), so
# that a value the spec refuses is named by the flag the user typed.
FLAGS = {"core_bundle": "--core", "core_max_per_task": "--max-per-task", "core_tasks": "--core-tasks",
         "lm_eval_tasks": "--lm-eval", "lm_eval_limit": "--limit", "humaneval": "--humaneval",
         "humaneval_limit": "--limit", "humaneval_samples": "--samples", "humaneval_temperature": "--temperature",
         "humaneval_max_new_tokens": "--max-new-tokens", "evalplus": "--evalplus", "evalplus_data": "--evalplus-data",
         "evalplus_limit": "--limit", "evalplus_chat": "--chat", "evalplus_max_new_tokens": "--max-new-tokens",
         "evalplus_find_zero": "--evalplus-find-zero", "evalplus_samples": "--samples",
         "evalplus_temperature": "--temperature", "evalplus_top_p": "--top-p", "evalplus_seed": "--seed",
         "val_sources": "--held-out", "val_samples": "--val-samples", "position_buckets": "--loss-by-position"}
FIELD = re.compile(r"\b(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")\b")


def spec_of(args: argparse.Namespace) -> EvalSpec:
    """The EvalSpec the flags ask for; a value it refuses raises EvalSpecError naming the flags."""
    values = {name: getattr(args, flag.removeprefix("--").replace("-", "_")) for name, flag in FLAGS.items()}
    values["core_tasks"] = args.core_tasks.split(",") if args.core_tasks else None
    values["evalplus"] = args.evalplus and ",".join(args.evalplus)
    values["val_sources"] = args.held_out.split(",") if args.held_out else []
    try:
        return EvalSpec(**values)
    except EvalSpecError as e:
        raise EvalSpecError(FIELD.sub(lambda m: FLAGS[m[1]], str(e))) from None


def position_problems(seq_len: int | None, buckets: int, max_seq_len: int | None = None) -> list[str]:
    """What is wrong with --loss-by-position's length ``seq_len`` (None: not known yet) and bucket count,
    for a model of ``max_seq_len`` tokens (None: not loaded yet)."""
    if seq_len is None:
        return []
    if seq_len <= 0:
        return [f"--seq-len: must be > 0 (got {seq_len})"]
    problems = []
    if max_seq_len is not None and seq_len > max_seq_len:
        problems.append(f"--seq-len {seq_len} exceeds the checkpoint's max_seq_len {max_seq_len} (a longer context "
                        "for a DCP checkpoint: --set max_seq_len=N)")
    if buckets > seq_len:  # the loop's rule (bucket_edges): at most one bucket a token, edges i * L // N
        problems.append(f"--loss-by-position {buckets}: more buckets than --seq-len {seq_len} has tokens")
    return problems


def init_distributed() -> str | None:
    """Join the torchrun process group, if launched by torchrun; returns the device to use."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
        return f"cuda:{torch.cuda.current_device()}"
    torch.distributed.init_process_group("gloo")
    return "cpu"


def main(argv: list[str] | None = None) -> dict | None:
    from data.chat import checkpoint_template
    from models.laneformer.checkpoint import parse_overrides

    p = argparse.ArgumentParser(prog="python -m eval.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="run dir, DCP step dir (a convert from-hf import too) or exported HF folder")
    p.add_argument("--flavor", help="model flavor (DCP; default: laneformer_config.json)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a model config field (a TOML value, as train.py's --set)")
    p.add_argument("--tokenizer", help="tokenizer.model or tokenizer folder (default: the checkpoint's own: an "
                   "export's or import's files, else the run's recipe.toml [data] tokenizer)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: CUDA when present)")
    p.add_argument("--core", metavar="BUNDLE", help="CORE bundle folder (tasks.csv + eval_data/)")
    p.add_argument("--max-per-task", type=int, default=default("core_max_per_task"),
                   help="CORE items per task (default: all)")
    p.add_argument("--core-tasks", help="comma-separated CORE labels (the rest count as missing)")
    p.add_argument("--lm-eval", metavar="TASKS", help="JSON/YAML file of lm-eval tasks (inline task dicts, lm-eval's "
                   "own task names) and their metadata, or a comma list of lm-eval task names (RULER: "
                   "niah_single_1,ruler_vt ...; at the checkpoint's max_seq_len unless the file's metadata sets "
                   "max_seq_lengths; its metadata ruler_files: local copies of what RULER downloads, eval.lm_harness); "
                   "--limit counts documents per task and length")
    p.add_argument("--humaneval", action="store_true", help="HumanEval pass@k (runs model code in a sandbox)")
    p.add_argument("--evalplus", type=evalplus_datasets, metavar="humaneval,mbpp",
                   help="HumanEval+ and/or MBPP+ pass@k, base and plus (a comma list): greedy pass@1, or with "
                        "--samples N --temperature T pass@1, 2, 4, ... and 10, 100 up to N")
    p.add_argument("--evalplus-data", metavar="FOLDER|FILE,FILE", help="a folder holding HumanEvalPlus.jsonl(.gz) "
                   "and MbppPlus.jsonl(.gz), or one release file per --evalplus dataset, in order")
    p.add_argument("--chat", action="store_true", help="EvalPlus instruct prompts through the chat template")
    p.add_argument("--evalplus-find-zero", choices=("fixed", "released"), default=default("evalplus_find_zero"),
                   help="HumanEval/32: upstream's fix (default) or evalplus 0.3.1 as released, which fails every "
                        "find_zero solution")
    p.add_argument("--limit", type=int, default=default("lm_eval_limit"),
                   help="documents per lm-eval task / HumanEval problems / EvalPlus tasks (default: all)")
    p.add_argument("--samples", type=int, default=default("humaneval_samples"),
                   help="HumanEval / EvalPlus answers per problem; above 1 needs --temperature above 0 (greedy "
                        "answers would all be the same one: refused)")
    p.add_argument("--temperature", type=float, default=default("humaneval_temperature"),
                   help="HumanEval / EvalPlus sampling temperature (0: greedy, one answer a problem)")
    p.add_argument("--top-p", type=float, default=default("evalplus_top_p"),
                   help="EvalPlus nucleus sampling (default: EvalPlus's own 0.95)")
    p.add_argument("--seed", type=int, default=default("evalplus_seed"),
                   help="EvalPlus sampling seed (each task draws from seed + its index: the same answers on any "
                        "number of ranks)")
    p.add_argument("--evalplus-out", metavar="DIR", help="write each dataset's samples and verdicts in EvalPlus's "
                   "files: DIR/humaneval.jsonl (what python -m evalplus.evaluate --samples reads), "
                   "humaneval.raw.jsonl, humaneval_eval_results.json; mbpp's alike")
    p.add_argument("--max-new-tokens", type=int, default=default("evalplus_max_new_tokens"),
                   help="completion length limit (default: each benchmark's own: HumanEval 512, EvalPlus 768)")
    p.add_argument("--loss-by-position", type=int, default=default("position_buckets"), metavar="N",
                   help="held-out loss by position in the document, eval/val_loss_pos/<start>-<end>, in N "
                        "buckets of --seq-len (edges i x L // N, as in the loop), on the --held-out sets: the numbers of a run's "
                        "[eval] position_buckets")
    p.add_argument("--held-out", metavar="[NAME=]DIR,...", help="held-out sets for --loss-by-position: a source split "
                   "by python -m data.held_out (its held_out/ is read) or a tokenized folder; NAME (default: the "
                   "folder's name) orders the set's documents as a run's set of that name does")
    p.add_argument("--seq-len", type=int, metavar="L", help="--loss-by-position's row length (default and at most: "
                   "the checkpoint's max_seq_len; a DCP checkpoint's can be raised with --set max_seq_len=N)")
    p.add_argument("--val-samples", type=int, default=default("val_samples"), metavar="S",
                   help="rows of --seq-len tokens scored per --held-out set, its first ones (as [eval] val_samples)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not (args.core or args.lm_eval or args.humaneval or args.evalplus or args.loss_by_position):
        p.error(f"nothing to evaluate: pass {TASK_FLAGS}")
    if bool(args.loss_by_position) != bool(args.held_out):
        p.error("--loss-by-position N scores the --held-out sets: pass both" if args.loss_by_position else
                "--held-out: only --loss-by-position N reads it: pass it too")
    if args.seq_len is not None and not args.loss_by_position:
        p.error("--seq-len: only --loss-by-position N reads it: pass it too")

    try:  # bad input (a --set, a bad value, a checkpoint that is not one, a config that does not fit it): exit 2
        overrides = parse_overrides(args.set)
        spec = spec_of(args)
        if problems := check_inputs(spec):  # bad input is answered before the model loads
            raise ValueError("\n".join(problems))
        evalplus_tasks = releases = None
        if spec.evalplus:  # a missing release file is bad input too: say so before loading the model
            from .evalplus import load_tasks

            datasets = spec.evalplus_datasets
            releases = evalplus_files(datasets, spec.evalplus_data)
            evalplus_tasks = [load_tasks(d, f, spec.evalplus_limit) for d, f in zip(datasets, releases)]
        held_out = None
        if spec.position_buckets:  # a missing set or a bucket count that cannot be: said before the model loads
            from .position_loss import held_out_mixtures, held_out_sets

            held_out = held_out_sets(spec.val_sources)
            if problems := position_problems(args.seq_len, spec.position_buckets):
                raise ValueError("\n".join(problems))
        device = init_distributed() or args.device
        loaded = load_checkpoint(args.checkpoint, flavor=args.flavor, overrides=overrides,
                                 tokenizer_path=args.tokenizer, device=device)
        if held_out is not None:
            seq_len = args.seq_len or loaded.max_seq_len
            if problems := position_problems(seq_len, spec.position_buckets, loaded.max_seq_len):
                raise ValueError("\n".join(problems))
            held_out = held_out_mixtures(held_out, seq_len, loaded.tokenizer)
        if spec.lm_eval_tasks is not None:  # RULER lengths the model cannot hold: bad input, not a score of 0
            from .lm_harness import check_lengths, load_task_file

            if problems := check_lengths(load_task_file(spec.lm_eval_tasks), loaded.max_seq_len):
                raise ValueError("\n".join(f"lm-eval tasks {spec.lm_eval_tasks}: {q}" for q in problems))
    except (ValueError, FileNotFoundError) as e:
        p.exit(2, f"error: {e}\n")
    log = print if dist.rank() == 0 else None
    for note in loaded.notes if log else ():
        log(note)
    report = run_evals(loaded.model_fn, loaded.tokenizer, spec, max_seq_len=loaded.max_seq_len, device=loaded.device,
                       log=log, evalplus_tasks=evalplus_tasks, held_out=held_out,
                       chat_template=checkpoint_template(args.checkpoint) if args.chat else None)  # a run's: the one it tuned with
    rank = dist.rank()
    if dist.distributed():
        torch.distributed.destroy_process_group()
    if rank != 0:
        return None
    print(f"\n{loaded.source}\n{table(report.metrics())}")
    if args.evalplus_out and report.evalplus:
        from .evalplus import RELEASES, write_samples

        for result, release in zip(report.evalplus, releases):
            samples = write_samples(result, args.evalplus_out, release).resolve()
            override = f"{RELEASES[result.dataset][2]}={Path(release).resolve()} " if release else ""
            print(f"{result.dataset}: wrote {samples} and its .raw.jsonl and _eval_results.json; EvalPlus reads "
                  f"them with: {override}python -m evalplus.evaluate --dataset {result.dataset} --samples {samples}"
                  + ("" if args.limit is None else " (once every task has samples: not with --limit)"))
    out = report_json(report, loaded.source, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
