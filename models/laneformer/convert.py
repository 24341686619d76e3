"""Convert Laneformer checkpoints to and from Hugging Face format.

    python -m models.laneformer.convert to-hf <run dir | step dir> <out dir> [--flavor NAME] [--set field=value ...]
        [--tokenizer DIR] [--chat-template SPEC]
    python -m models.laneformer.convert from-hf <hf dir> <out dir> [--set field=value ...] [--ignore-key KEY ...]

``to-hf`` reads a torchtitan DCP checkpoint (the latest complete
``checkpoints/step-<N>`` of a run dir, or one step dir) and writes an HF
folder (see ``hf/export.py``). The model config comes from ``--flavor`` if
given, else from ``laneformer_config.json`` in the step dir or the run dir;
``--set`` overrides fields either way. The export is self-contained: its
tokenizer is ``--tokenizer`` if given, else the tokenizer files an import
left in the step dir, else the run's resolved recipe (``recipe.toml``,
``[data] tokenizer``), checked against the fingerprint in the run's data
manifests. Its chat template is ``--chat-template`` if given, else the
checkpoint's own (an import's, else the run's ``recipe.toml``
``[data] chat_template``: the template it was tuned with), else data.chat's
default.

``from-hf`` turns a released-layout folder into a DCP checkpoint plus
``laneformer_config.json`` (see ``hf/import_hf.py``). It works out which
code revision the config was written for (``hf/kog_releases.py``), prints
where every native field came from, and refuses (exit 2, the key named) a
config it cannot reproduce exactly. ``--set`` overrides an inferred field on
purpose; ``--ignore-key`` accepts a key of Kog's newer code that is known to
have no effect.

``--set field=value`` takes the recipe's grammar: the value is a TOML value
(``2``, ``true``, ``[0, 1]``, ``"flush"``), else a bare string.
Bad input exits with status 2 and a message naming the file and key.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from data.chat import DEFAULT, folder_template, resolve_template
from rundir import step_number

from . import laneformer_configs
from .checkpoint import open_checkpoint, parse_overrides
from .hf.export import ModelCard, export_hf
from .hf.import_hf import import_hf
from .hf.kog_releases import laneformer_tp_keys
from .hf.safetensors_io import parse_size


def to_hf_command(args) -> None:
    checkpoint = open_checkpoint(args.source)
    if checkpoint.kind == "hf":
        raise ValueError(f"{args.source}: already a Hugging Face export (to-hf reads a run dir or a DCP step dir)")
    step = checkpoint.dcp_dir
    config = checkpoint.model_config(args.flavor, parse_overrides(args.set))
    tokenizer, notes = (Path(args.tokenizer), []) if args.tokenizer else checkpoint.tokenizer()
    template = args.chat_template or checkpoint.chat_template()
    resolve_template(template)  # a bad --chat-template fails before the weights are read
    notes.append(f"chat template: {template} (from {'--chat-template' if args.chat_template else 'the checkpoint'})"
                 if template else f"chat template: {DEFAULT} (the project default; the checkpoint names none)")
    state_dict = checkpoint.load_weights(config)
    card = ModelCard(
        recipe=args.recipe,
        step=step_number(step),
        tokens_seen=args.tokens_seen,
        evals=json.loads(Path(args.evals).read_text()) if args.evals else None,
    )
    out = export_hf(
        state_dict, config, args.out,
        tokenizer_dir=tokenizer,
        card=card,
        dtype=None if args.dtype == "keep" else getattr(torch, args.dtype),
        max_shard_bytes=parse_size(args.max_shard_size),
        overwrite=args.overwrite,
        chat_template=template,
    )
    _, why = laneformer_tp_keys(config)
    notes.append("Kog's laneformer_tp code reads this export: " + ("yes (its keys are in config.json)" if not why
                 else "no, config.json says why: " + "; ".join(why)))
    for line in notes:
        print(line)
    print(f"wrote {out} from {step}")


def from_hf_command(args) -> None:
    report = import_hf(args.source, args.out, parse_overrides(args.set), overwrite=args.overwrite,
                       ignorable=tuple(args.ignore_key))
    for line in report.lines():
        print(line)
    own = folder_template(args.out)
    print(f"chat template: the release's, kept in {own} (SFT from this checkpoint uses it unless the recipe "
          "sets [data] chat_template)" if own else
          f"chat template: the release has none; SFT from this checkpoint uses the recipe's or {DEFAULT}")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.laneformer.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    to = sub.add_parser("to-hf", help="DCP checkpoint -> HF folder")
    to.add_argument("source", help="run dir (latest complete step) or checkpoint step dir")
    to.add_argument("out")
    to.add_argument("--flavor", help=f"model flavor, one of {sorted(laneformer_configs)}")
    to.add_argument("--tokenizer", help="tokenizer.model, or a folder of tokenizer files (default: the run's)")
    to.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float32"], help="weights dtype")
    to.add_argument("--max-shard-size", default="5GB", help="shard the safetensors above this size")
    to.add_argument("--recipe", help="recipe name for the model card")
    to.add_argument("--tokens-seen", type=int, help="training tokens, for the model card")
    to.add_argument("--evals", help="JSON file {task: score} for the model card")
    to.add_argument("--chat-template", metavar="SPEC", help="data.chat template name, .jinja file or HF folder "
                    "(default: the checkpoint's: an import's own, else the run's recipe.toml [data] chat_template)")
    to.set_defaults(run=to_hf_command)

    frm = sub.add_parser("from-hf", help="HF folder (released layout) -> DCP checkpoint + laneformer_config.json")
    frm.add_argument("source")
    frm.add_argument("out")
    frm.add_argument("--ignore-key", action="append", default=[], metavar="KEY",
                     help="a config.json key known to have no effect (Kog's newer code)")
    frm.set_defaults(run=from_hf_command)

    for p in (to, frm):
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
        p.add_argument("--overwrite", action="store_true", help="replace an existing out dir")

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)  # bad input, as argparse's own usage errors


if __name__ == "__main__":
    main()
