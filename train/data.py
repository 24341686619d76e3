"""A recipe's data, source by source: download, tokenize, verify.

    python -m train.data download --recipe phase1 --source web-high [--slurm --partition P]
    python -m train.data tokenize --recipe phase1 --source web-high [--tasks N --slurm --partition P ...]
    python -m train.data verify --recipe phase1
    python -m train.data held-out --recipe phase1 [--source web-high]   # split off held-out documents, no re-tokenization

The recipe says everything (``[[data.sources]]``: hub_id, subset, split,
revision, text_key, chat_key or pairs, exclude; ``[data] root`` and tokenizer), so the
commands take only its name. The data layer (data.download, data.tokenize,
data.verify) does the work and knows nothing of recipes; this module reads the
recipe and hands it the values.

Layout under the data root: ``hub/<org>/<name>/`` holds the downloaded copy of a
Hub dataset (every config fetched into the same folder, with its card), and
each source's ``path`` its shards. ``tokenize`` reads the local copy when
``download`` made one (checking it is the recipe's revision), else the Hub.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from data import download as D
from data import held_out as H
from data import tokenize as T
from data.mixture import SourceSpec
from data.verify import verify
from train import recipe as R


def source(recipe: R.Recipe, name: str) -> SourceSpec:
    sources = {s.name: s for s in recipe.data.sources}
    if name not in sources:
        raise R.RecipeError(f"{recipe.path}: [[data.sources]] has no source named {name!r}; "
                            f"sources: {', '.join(sources)}")
    return sources[name]


def local_copy(recipe: R.Recipe, src: SourceSpec) -> Path:
    """Where data.download puts (and data.tokenize looks for) a Hub source's files."""
    assert src.hub_id, "asked only of a Hub source (_needs_hub_id)"
    return R.in_data_root(recipe, Path("hub") / src.hub_id)


def _needs_hub_id(recipe: R.Recipe, src: SourceSpec, what: str) -> None:
    if not src.hub_id:
        raise R.RecipeError(f"{recipe.path}: [[data.sources]] {src.name}: hub_id: not set, so there is nothing "
                            f"to {what} from the Hub" + ("" if src.input else "; use data.tokenize --input instead"))


def download(recipe: R.Recipe, src: SourceSpec) -> dict:
    _needs_hub_id(recipe, src, "download")
    assert src.hub_id  # for the type check: _needs_hub_id raised otherwise
    record = D.download(src.hub_id, local_copy(recipe, src), src.subset, src.split, src.revision)
    if not src.revision:
        print(f"warning: {recipe.path}: [[data.sources]] {src.name} has no revision; pin what was fetched with "
              f'revision = "{record["revision"]}"', file=sys.stderr)
    return record


def tokenize_kwargs(recipe: R.Recipe, src: SourceSpec) -> dict:
    """data.tokenize.run's arguments for a recipe source: its local copy if downloaded, else the Hub
    (or its bundled ``input``); the manifest records hub id, subset, split and revision either way."""
    common = dict(tokenizer=recipe.data.tokenizer, text_key=src.text_key, split=src.split, subset=src.subset,
                  chat_key=src.chat_key, chat_template=recipe.data.chat_template if src.chat_key or src.pairs else None,
                  exclude=src.exclude or None, pairs=src.pairs, held_out=src.held_out or None,
                  seq_len=recipe.training.seq_len if src.pairs else None,  # a pair over seq_len is refused
                  decontaminate=src.decontaminate or None, min_doc_tokens=src.min_doc_tokens,
                  concat_by=src.concat_by, concat_order=src.concat_order,
                  evalplus_data=recipe.eval.evalplus_data, core_bundle=recipe.eval.core_bundle)
    if src.input:
        return dict(input_spec=src.input, **common)
    _needs_hub_id(recipe, src, "tokenize")
    folder = local_copy(recipe, src)
    record = D.read_record(folder, src.subset)
    if record is None:
        return dict(input_spec=src.hub_id, hub=True, revision=src.revision, **common)
    if src.revision and record["revision"] != src.revision:
        raise R.RecipeError(f"{recipe.path}: [[data.sources]] {src.name}: revision: {src.revision}, but the copy "
                            f"in {folder} is {record['revision']}; run python -m train.data download --recipe "
                            f"{recipe.path} --source {src.name} again")
    description = {"kind": "hub", "dataset": src.hub_id, "split": src.split, "subset": src.subset,
                   "revision": record["revision"], "text_key": src.text_key, "local_copy": str(folder)}
    return dict(input_spec=str(folder), hub=True, description=description, **common)


def split_held_out(recipe: R.Recipe, sources: list[SourceSpec]) -> int:
    """data.held_out's split of each source at its ``held_out`` (a source already split alike is left as it is)."""
    for src in sources:
        if not src.held_out:
            raise R.RecipeError(f"{recipe.path}: [[data.sources]] {src.name}: held_out: not set ([data] held_out or "
                                "the source's own), so there is nothing to hold out")
        print(H.describe(Path(src.path), H.split(src.path, src.held_out)))
    return 0


def _sbatch(argv: list[str], a: argparse.Namespace, name: str) -> None:
    """Submit this same command (without --slurm) as a one-task SLURM job."""
    command = [sys.executable, "-m", "train.data", *[x for x in argv if x != "--slurm"]]
    script = "\n".join(["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --partition={a.partition}",
                        f"#SBATCH --time={a.time}", "#SBATCH --cpus-per-task=2", "#SBATCH --open-mode=append",
                        f"#SBATCH --output={Path.cwd() / f'{name}-%j.log'}",
                        *(f"#SBATCH --{kv}" for kv in a.sbatch_arg),
                        f"cd {shlex.quote(str(R.REPO))}", shlex.join(command), ""])
    out = subprocess.run(["sbatch"], input=script, text=True, capture_output=True)
    if out.returncode:
        raise OSError(f"sbatch failed: {out.stderr.strip()}")
    print(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m train.data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="fetch a source's files at its revision into the data root")
    t = sub.add_parser("tokenize", help="tokenize a source into its path (from its local copy if downloaded)")
    v = sub.add_parser("verify", help="check every source's shards against their manifest checksums")
    h = sub.add_parser("held-out", aliases=[H.OLD_KEY], help="split each source's held-out documents off its shards, at the recipe's "
                       "held_out (data.held_out; no re-tokenization)")
    h.add_argument("--source", help="a [[data.sources]] name (default: every source with a held_out setting)")
    for q in (d, t, v, h):
        q.add_argument("--recipe", required=True)
        q.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    for q in (d, t):
        q.add_argument("--source", required=True, help="a [[data.sources]] name")
    T.add_run_options(t)
    d.add_argument("--slurm", action="store_true", help="run the download as a SLURM job")
    d.add_argument("--partition")
    d.add_argument("--time", default="24:00:00")
    d.add_argument("--sbatch-arg", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    try:
        recipe = R.load(a.recipe, a.set)
        if a.command == "verify":
            return verify([Path(s.path) for s in recipe.data.sources]
                          + [Path(x) for x in recipe.validation_sets.values()])
        if a.command == H.OLD_KEY:
            print(f"{H.OLD_KEY}: renamed held-out in laneformer 0.2; run as held-out (the old name is read until the "
                  "next release)", file=sys.stderr)
        if a.command in ("held-out", H.OLD_KEY):
            return split_held_out(recipe, [source(recipe, a.source)] if a.source else
                                  [s for s in recipe.data.sources if s.held_out])
        src = source(recipe, a.source)
        if problems := R.check_needs(recipe):  # a plan the data cannot meet: found before any download
            raise R.RecipeError("\n".join(problems))
        if a.command == "download":
            if a.slurm:
                if not a.partition:
                    d.error("--slurm needs --partition")
                _sbatch(argv, a, f"download_{src.name}")
                return 0
            record = download(recipe, src)
            print(f"{local_copy(recipe, src)}: {src.hub_id} {src.subset or ''} at commit {record['revision']}")
            return 0
        a.out = src.path
        T.run_and_report(a, t, **tokenize_kwargs(recipe, src))
        return 0
    except (ValueError, OSError) as e:  # RecipeError, DownloadError, the Hub's errors
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
