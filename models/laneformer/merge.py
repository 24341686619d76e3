"""Merge checkpoints of one model: their weighted average, written as a Hugging Face export.

    python -m models.laneformer.merge OUT CKPT CKPT... [--weights W,W,...] [--tokenizer DIR] [--overwrite]

Why: the average of checkpoints of one run, or of runs from one start, is often better than any of them.
Llama 3 ("The Llama 3 Herd of Models", arXiv 2407.21783, 3.4.3 Annealing) computes "the average of model
checkpoints (Polyak (1991) averaging) during annealing to produce the final pre-trained model". OLMo 2
("2 OLMo 2 Furious", arXiv 2501.00656, 4.5 Final Midtraining mix and Checkpoint Soups) finds that merging
("souping") 3 checkpoints annealed on three permutations of the same data mix is as good as or better than
any one of them, and releases soups: 7B averages three 50B-token anneals, 13B and 32B three 100B ones and
a 300B one. Two checkpoints with ``--weights 0.7,0.3`` interpolate between them.

Each CKPT is anything ``models.laneformer.checkpoint.open_checkpoint`` reads (a run dir, a DCP step dir,
a ``convert from-hf`` import, an HF export), in any mix; their model configs (``laneformer_config.json``
or ``config.json``) must agree field by field, else it refuses, naming each field, both values and both
paths. ``--weights`` (default: equal) must be one per checkpoint, none negative, summing to 1 (within
1e-6): they are not normalised, so a mistyped weight is refused, not silently rescaled. Only the model
weights are averaged, in float64, one checkpoint read at a time (the sum's memory is 8 bytes a parameter),
then stored in the first checkpoint's dtype; optimizer state, data order and step are not merged: the
output is a new starting point, not a run to resume.

OUT is written by ``hf/export.py``'s exporter (under a temporary name, renamed when complete: never a
half-written OUT), with the first checkpoint's tokenizer (``--tokenizer`` to give another) and chat
template, so it is a checkpoint like any export: ``eval.run --checkpoint OUT``, ``generate``,
``push``, and ``[checkpoint] init_from = OUT`` take it. Bad input exits 2 naming it (a path, a weight, a
config field, the tokenizer or template: before any weights are read; weights that do not fit the config:
as they are read), and OUT is not written.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from data.chat import resolve_template

from . import native_fields
from .checkpoint import Checkpoint, open_checkpoint
from .hf.export import export_hf


def parse_weights(text: str | None, count: int) -> list[float]:
    """``"0.7,0.3"`` -> [0.7, 0.3]; None -> equal weights. Raises ValueError unless there is one per
    checkpoint, each finite and >= 0, summing to 1 within 1e-6 (they are not normalised)."""
    if text is None:
        return [1 / count] * count
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--weights {text!r}: not a comma-separated list of numbers") from None
    if len(weights) != count:
        raise ValueError(f"--weights {text!r}: {len(weights)} weight(s) for {count} checkpoints")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"--weights {text!r}: each weight must be a finite number >= 0")
    if abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"--weights {text!r}: they sum to {sum(weights):g}, not 1 (weights are not normalised)")
    return weights


def check_same_model(checkpoints: list[Checkpoint]) -> None:
    """Raise ValueError naming every config field in which a checkpoint differs from the first."""
    first = native_fields(checkpoints[0].model_config())
    problems = []
    for other in checkpoints[1:]:
        fields = native_fields(other.model_config())
        problems += [f"{name}: {first[name]!r} in {checkpoints[0].path}, {fields[name]!r} in {other.path}"
                     for name in first if fields[name] != first[name]]
    if problems:
        raise ValueError("checkpoints of different models cannot be merged:\n  " + "\n  ".join(problems))


def merge(checkpoints: list[Checkpoint], weights: list[float]) -> dict[str, torch.Tensor]:
    """sum_i weights[i] * checkpoint i's weights, accumulated in float64, in the first's dtypes. Each is
    read against the first's config: names and shapes that differ from it raise ValueError."""
    config = checkpoints[0].model_config()
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for checkpoint, weight in zip(checkpoints, weights, strict=True):
        for name, tensor in checkpoint.load_weights(config).items():
            dtypes.setdefault(name, tensor.dtype)
            if name in total:
                total[name].add_(tensor.double(), alpha=weight)
            else:
                total[name] = tensor.double().mul_(weight)
    return {name: tensor.to(dtypes[name]) for name, tensor in total.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.laneformer.merge", description=__doc__.split("\n\n")[0],
                                     epilog="Optimizer state is not merged: OUT starts runs and is evaluated, "
                                            "it does not resume one.")
    parser.add_argument("out", metavar="OUT", help="the HF export to write")
    parser.add_argument("checkpoints", metavar="CKPT", nargs="+",
                        help="run dir, DCP step dir, convert from-hf import or HF export (two or more)")
    parser.add_argument("--weights", metavar="W,W,...", help="one per CKPT, >= 0, summing to 1: refused "
                        "otherwise, never normalised (default: equal)")
    parser.add_argument("--tokenizer", help="tokenizer.model or tokenizer folder for OUT (default: the first "
                        "CKPT's own)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    try:
        out = Path(args.out)
        if len(args.checkpoints) < 2:
            raise ValueError("give two or more checkpoints to merge")
        weights = parse_weights(args.weights, len(args.checkpoints))
        if out.exists() and not args.overwrite:
            raise FileExistsError(f"{out} exists (pass --overwrite to replace it)")
        for path in args.checkpoints:
            if not Path(path).exists():
                raise FileNotFoundError(f"{path}: does not exist")
            if Path(path).resolve() == out.resolve():
                raise ValueError(f"{path}: OUT is one of the checkpoints")
        checkpoints = [open_checkpoint(path) for path in args.checkpoints]
        check_same_model(checkpoints)
        first = checkpoints[0]
        tokenizer = Path(args.tokenizer) if args.tokenizer else first.tokenizer()[0]
        template = first.chat_template()
        resolve_template(template)  # a bad one fails before the weights are read, as in convert
        state_dict = merge(checkpoints, weights)
        export_hf(state_dict, first.model_config(), out, tokenizer_dir=tokenizer, overwrite=args.overwrite,
                  chat_template=template)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2  # bad input, as argparse's own usage errors
    for checkpoint, weight in zip(checkpoints, weights, strict=True):
        print(f"{weight:g} x {checkpoint.folder}")
    print(f"tokenizer: {tokenizer}; chat template: {template or 'the default'}")
    print(f"wrote {out} (model weights only; optimizer state is not merged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
