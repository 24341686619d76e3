"""Check tokenized sources byte for byte against the checksums in their manifests.

    python -m data.verify assets/sample_data/code [more dirs...]
    python -m train.data verify --recipe phase1   # every [[data.sources]] and [eval] val_sources

Training only checks shard sizes when it opens them (instant, every start);
run this after copying data to a cluster, restoring it, or a disk incident:
it reads every shard, showing bytes checked of the total on stderr. Exit 0
when all match; 2 naming the first file that differs, is missing or has no
recorded checksum.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from data.shards import ShardError, load_manifest, verify_checksums
from rundir.progress import progress


def _bytes(directory: Path) -> int:
    """Bytes verify_checksums reads in ``directory`` (0 when its manifest cannot be read)."""
    try:
        manifest = load_manifest(directory)
    except ShardError:
        return 0
    suffixes = ("", ".index") + ((".loss",) if manifest.get("loss_mask") else ())
    return sum(os.path.getsize(directory / f"{e['file']}{x}") for e in manifest["shards"] for x in suffixes
               if (directory / f"{e['file']}{x}").is_file())


def verify(dirs: list[Path]) -> int:
    """Verify each dir; 0 when all match, else 2 after naming the first problem."""
    with progress(total=sum(_bytes(Path(d)) for d in dirs), desc="verify", unit="B", unit_scale=True) as bar:
        for directory in dirs:
            t0 = time.monotonic()
            try:
                source = verify_checksums(directory, bar)
            except ShardError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"ok {directory}: {len(source.manifest['shards'])} shards, {source.num_tokens:,} tokens "
                  f"({time.monotonic() - t0:.1f} s)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path, help="tokenized source dirs (data.tokenize output)")
    return verify(p.parse_args(argv).dirs)


if __name__ == "__main__":
    sys.exit(main())
