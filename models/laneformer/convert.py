"""Convert Laneformer checkpoints to and from Hugging Face format.

    python -m models.laneformer.convert to-hf <run dir | step dir> <out dir> [--flavor NAME] [--set field=value ...]
    python -m models.laneformer.convert from-hf <hf dir> <out dir> [--set field=value ...]

``to-hf`` reads a torchtitan DCP checkpoint (the latest complete
``checkpoints/step-<N>`` of a run dir, or one step dir) and writes an HF
folder (see ``hf/export.py``). The model config comes from ``--flavor`` if
given, else from ``laneformer_config.json`` in the step dir or the run dir
(``from-hf`` writes one; so can a trainer); ``--set`` overrides fields
either way. ``from-hf`` turns a released-layout folder into a DCP checkpoint
plus ``laneformer_config.json`` (see ``hf/import_hf.py``).

Released config keys (Kog's ``laneformer-2b-it``, model_type ``laneformer``
or ``laneformer_tp``) -> native ``Laneformer.Config`` fields:

    hidden_size -> dim                  num_hidden_layers -> n_layers
    num_attention_heads -> n_heads      num_key_value_heads -> n_kv_heads (absent: n_heads)
    head_dim -> head_dim (absent: hidden_size // num_attention_heads, as Kog's code computes it)
    intermediate_size -> ffn_hidden_dim max_position_embeddings -> max_seq_len
    vocab_size, rope_theta, norm_eps -> same names
    num_lanes -> n_lanes                broadcast_delay -> delay
    use_early_comm true/false -> early_mode "present"/"scaled" (early_mode wins if present)
    use_comm false -> delay = n_layers with early_mode "scaled": no exchange anywhere
    pre_norm_lane_agg true/false -> final_agg "norm_of_sum"/"mean_of_norms"
    sliding_window -> window_size (null: no window layers)
    swa_layers [i, ...] -> window_layers; else sliding_window_n_layers N -> layers 0..N-1
        (N < 0: the last -N layers, as in Kog's code)
    early_send_forward, late_mode: absent from releases -> defaults False, "drop"
        (Kog's newer revision; the older laneformer_tp code sent every layer
        forward: ``--set early_send_forward=true`` to reproduce it)

Refused: lm_head_type other than "replicate", replicated_rmsn_scale false,
tie_word_embeddings true, use_comm false with use_early_comm true. Other
keys (multiple_of, depth_init, ...) are listed as ignored.
"""

import argparse
import ast
import dataclasses
import json
import sys
from pathlib import Path

import torch

from . import laneformer_configs
from .hf.checkpoint_io import load_dcp, step_dir, step_number
from .hf.config_map import CONFIG_FILE, read_native_config
from .hf.export import ModelCard, export_hf
from .hf.import_hf import import_hf
from .hf.safetensors_io import parse_size
from .model import Laneformer


def parse_overrides(pairs: list[str]) -> dict:
    """``["delay=1", "late_mode=flush", "window_layers=[0,1]"]`` -> a dict of native field values."""
    known = {f.name for f in dataclasses.fields(Laneformer.Config)}
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in known:
            raise SystemExit(f"--set {pair!r}: expected field=value with a Laneformer.Config field")
        try:
            out[name] = json.loads(text)
        except json.JSONDecodeError:
            try:
                out[name] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                out[name] = text
    return out


def resolve_config(step: Path, flavor: str | None, overrides: dict) -> Laneformer.Config:
    """The model config of a checkpoint: ``--flavor``, else ``laneformer_config.json`` beside it or in its run dir."""
    if flavor is not None:
        if flavor not in laneformer_configs:
            raise SystemExit(f"unknown flavor {flavor!r}; known: {sorted(laneformer_configs)}")
        return dataclasses.replace(laneformer_configs[flavor](), **overrides)
    for folder in (step, step.parent.parent):
        if (folder / CONFIG_FILE).exists():
            return read_native_config(folder / CONFIG_FILE, overrides)
    raise SystemExit(f"no {CONFIG_FILE} in {step} or {step.parent.parent}: give --flavor (and --set overrides)")


def to_hf_command(args) -> None:
    step = step_dir(Path(args.source))
    config = resolve_config(step, args.flavor, parse_overrides(args.set))
    state_dict = load_dcp(step, config)
    card = ModelCard(
        recipe=args.recipe,
        step=step_number(step),
        tokens_seen=args.tokens_seen,
        evals=json.loads(Path(args.evals).read_text()) if args.evals else None,
    )
    out = export_hf(
        state_dict, config, args.out,
        tokenizer_dir=args.tokenizer,
        card=card,
        dtype=None if args.dtype == "keep" else getattr(torch, args.dtype),
        max_shard_bytes=parse_size(args.max_shard_size),
        overwrite=args.overwrite,
    )
    print(f"wrote {out} from {step}")


def from_hf_command(args) -> None:
    report = import_hf(args.source, args.out, parse_overrides(args.set), overwrite=args.overwrite)
    for line in report.lines():
        print(line)
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.laneformer.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    to = sub.add_parser("to-hf", help="DCP checkpoint -> HF folder")
    to.add_argument("source", help="run dir (latest complete step) or checkpoint step dir")
    to.add_argument("out")
    to.add_argument("--flavor", help=f"model flavor, one of {sorted(laneformer_configs)}")
    to.add_argument("--tokenizer", help="folder with tokenizer.model / tokenizer.json / ...")
    to.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float32"], help="weights dtype")
    to.add_argument("--max-shard-size", default="5GB", help="shard the safetensors above this size")
    to.add_argument("--recipe", help="recipe name for the model card")
    to.add_argument("--tokens-seen", type=int, help="training tokens, for the model card")
    to.add_argument("--evals", help="JSON file {task: score} for the model card")
    to.set_defaults(run=to_hf_command)

    frm = sub.add_parser("from-hf", help="HF folder (released layout) -> DCP checkpoint + laneformer_config.json")
    frm.add_argument("source")
    frm.add_argument("out")
    frm.set_defaults(run=from_hf_command)

    for p in (to, frm):
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
        p.add_argument("--overwrite", action="store_true", help="replace an existing out dir")

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
