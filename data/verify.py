"""Check tokenized sources byte for byte against the checksums in their manifests.

    python -m data.verify --recipe phase1        # every [[data.sources]] and [eval] val_sources
    python -m data.verify assets/sample_data/code [more dirs...]

Training only checks shard sizes when it opens them (instant, every start);
run this after copying data to a cluster, restoring it, or a disk incident:
it reads every shard. Exit 0 when all match; 2 naming the first file that
differs, is missing or has no recorded checksum.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from data.shards import ShardError, verify_checksums


def recipe_sources(name: str) -> list[Path]:
    """The tokenized dirs a recipe reads: its training sources and validation sources."""
    from train import recipe as R  # the CLI only: data/ does not import train/ as a library

    recipe = R.load(name)
    return [Path(s.path) for s in recipe.data.sources] + [Path(v) for v in recipe.eval.val_sources]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="*", type=Path, help="tokenized source dirs (data.tokenize output)")
    p.add_argument("--recipe", help="verify every source the recipe names")
    args = p.parse_args(argv)
    try:
        dirs = [*args.dirs, *(recipe_sources(args.recipe) if args.recipe else [])]
    except ValueError as e:  # RecipeError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not dirs:
        p.error("give source dirs or --recipe")
    for directory in dirs:
        t0 = time.monotonic()
        try:
            source = verify_checksums(directory)
        except ShardError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"ok {directory}: {len(source.manifest['shards'])} shards, {source.num_tokens:,} tokens "
              f"({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
