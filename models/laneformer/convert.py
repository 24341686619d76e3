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
import dataclasses
import json
import sys
import tomllib
from pathlib import Path

import torch

import rundir
from data.chat import DEFAULT, checkpoint_template, folder_template, resolve_template
from rundir import MODEL_CONFIG_FILE as CONFIG_FILE
from rundir import step_number

from . import NATIVE_FIELDS, laneformer_configs, read_native_config
from .hf.checkpoint_io import load_dcp, step_dir
from .hf.export import TOKENIZER_FILES, ModelCard, export_hf
from .hf.import_hf import import_hf
from .hf.kog_releases import laneformer_tp_keys
from .hf.safetensors_io import parse_size
from .model import Laneformer


def parse_overrides(pairs: list[str]) -> dict:
    """``["delay=1", "late_mode=flush", "window_layers=[0,1]"]`` -> a dict of native field values."""
    out = {}
    for pair in pairs:
        name, value = rundir.parse_set(pair)
        if name not in NATIVE_FIELDS:
            raise ValueError(f"--set {pair!r}: {name!r} is not a Laneformer.Config field; known: {sorted(NATIVE_FIELDS)}")
        out[name] = value
    return out


def resolve_config(step: Path, flavor: str | None, overrides: dict) -> Laneformer.Config:
    """The model config of a checkpoint: ``--flavor``, else ``laneformer_config.json`` beside it or in its run dir.

    Raises ValueError (unknown flavor, bad field) or FileNotFoundError (no config found).
    """
    if flavor is not None:
        if flavor not in laneformer_configs:
            raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(laneformer_configs)}")
        return dataclasses.replace(laneformer_configs[flavor](), **overrides)
    for folder in (step, step.parent.parent):
        if (folder / CONFIG_FILE).exists():
            return read_native_config(folder / CONFIG_FILE, overrides)
    raise FileNotFoundError(f"no {CONFIG_FILE} in {step} or {step.parent.parent}: give --flavor (and --set overrides)")


def resolve_tokenizer(step: Path) -> tuple[Path, list[str]]:
    """(the tokenizer an export of ``step`` ships, notes for the user).

    The tokenizer files an import left in the step dir, else the run's resolved
    recipe ``[data] tokenizer``, whose fingerprint must match every data
    manifest of the run that can be read. Raises FileNotFoundError or ValueError.
    """
    if any((step / name).is_file() for name in TOKENIZER_FILES):
        return step, []
    from data.shards import MANIFEST
    from data.tokenizer import fingerprint, resolve_model_path

    run = step.parent.parent
    recipe_file = run / rundir.RECIPE_FILE
    if not recipe_file.is_file():
        raise FileNotFoundError(f"{step}: no tokenizer files and no {recipe_file} naming one; pass --tokenizer DIR")
    recipe = tomllib.loads(recipe_file.read_text())
    named = recipe.get("data", {}).get("tokenizer")
    if not named:
        raise ValueError(f"{recipe_file}: [data] tokenizer: absent; pass --tokenizer DIR")
    try:
        model = resolve_model_path(_in_repo(named))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{recipe_file}: [data] tokenizer: {e}; pass --tokenizer DIR") from None
    expected, notes, checked = fingerprint(model), [], 0
    for source in recipe["data"].get("sources", []):
        manifest = _in_repo(source.get("path", "")) / MANIFEST
        if not manifest.is_file():
            notes.append(f"tokenizer not checked against source {source.get('name')!r}: no {manifest}")
            continue
        found = json.loads(manifest.read_text())["tokenizer"]["fingerprint"]
        if found != expected:
            raise ValueError(f"{recipe_file}: [data] tokenizer: {model} has fingerprint {expected[:16]}…, but "
                             f"{manifest} says the run's data was tokenized with {found[:16]}…; "
                             "pass --tokenizer DIR (the one it was)")
        checked += 1
    notes.insert(0, f"tokenizer {model} (from {recipe_file}; fingerprint matches {checked} data manifest(s))")
    return model, notes


def _in_repo(path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else rundir.REPO / path


def to_hf_command(args) -> None:
    step = step_dir(Path(args.source))
    config = resolve_config(step, args.flavor, parse_overrides(args.set))
    if args.tokenizer:
        tokenizer, notes = Path(args.tokenizer), []
    else:
        tokenizer, notes = resolve_tokenizer(step)
    template = args.chat_template or checkpoint_template(step)
    resolve_template(template)  # a bad --chat-template fails before the weights are read
    notes.append(f"chat template: {template} (from {'--chat-template' if args.chat_template else 'the checkpoint'})"
                 if template else f"chat template: {DEFAULT} (the project default; the checkpoint names none)")
    state_dict = load_dcp(step, config)
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
