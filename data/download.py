"""Pre-download one config of a Hub dataset to shared storage, resumable, at a pinned commit.

    python -m data.download --hub-id ORG/NAME [--subset CONFIG] [--split train] [--revision SHA] --out DIR
    python -m train.data download --recipe R --source NAME    # a recipe source, into its data root

Tokenizing straight from the Hub downloads a whole config per task (or, streamed
by hundreds of tasks, gets rate-limited); at terabytes the robust route is one
resumable download to shared storage, then tokenization from that copy
(data.tokenize reads it like the Hub dataset, through its card).

Which files: the dataset card's ``configs`` (its README.md front matter) map each
config to ``data_files`` patterns; exactly those of ``--subset`` (and its split)
are fetched, with huggingface_hub's own ``snapshot_download`` (resumable: a rerun
skips complete files and continues partial ones; it shows its own progress).
A dataset with several configs and no default needs ``--subset``.

The revision is resolved to a commit first and everything is fetched at that
commit; ``download-<subset>.json`` in the folder records hub id, subset, split,
commit and patterns, and data.tokenize copies it into the shard manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

RECORD = "download-{subset}.json"


class DownloadError(ValueError):
    """The dataset or config cannot be fetched as asked."""


def card_configs(card: Path) -> list[dict]:
    """The ``configs`` list of a dataset card's YAML front matter ([] when it has none)."""
    from huggingface_hub.repocard import metadata_load

    return (metadata_load(card) or {}).get("configs") or []


def config_patterns(configs: list[dict], hub_id: str, subset: str | None, split: str) -> list[str]:
    """The ``data_files`` patterns of ``subset`` (for ``split`` where the card says per split)."""
    if not configs:
        if subset:
            raise DownloadError(f"{hub_id}: its card defines no configs, so subset {subset!r} cannot be chosen")
        return ["*"]
    names = [c.get("config_name", "default") for c in configs]
    if subset is None:
        defaults = [c for c in configs if c.get("default")] or (configs if len(configs) == 1 else [])
        if not defaults:
            raise DownloadError(f"{hub_id} has {len(configs)} configs and no default: set subset to one of "
                                f"{', '.join(names)}")
        config = defaults[0]
    elif subset in names:
        config = configs[names.index(subset)]
    else:
        raise DownloadError(f"{hub_id}: no config {subset!r}; its card lists {', '.join(names)}")
    files = config.get("data_files")
    if files is None:
        raise DownloadError(f"{hub_id}: config {config.get('config_name')!r} lists no data_files in its card")
    entries = files if isinstance(files, list) else [files]
    patterns: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            patterns.append(entry)
        elif entry.get("split", split) == split:
            path = entry["path"]
            patterns += path if isinstance(path, list) else [path]
    if not patterns:
        raise DownloadError(f"{hub_id}: config {config.get('config_name')!r} has no split {split!r} in its card")
    return patterns


def download(hub_id: str, out: str | Path, subset: str | None = None, split: str = "train",
             revision: str | None = None) -> dict:
    """Fetch ``subset``'s files of ``hub_id`` at ``revision`` into ``out``; returns the record."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    out = Path(out)
    commit = HfApi().dataset_info(hub_id, revision=revision).sha
    card = hf_hub_download(hub_id, "README.md", repo_type="dataset", revision=commit)  # into the HF cache
    patterns = config_patterns(card_configs(Path(card)), hub_id, subset, split)
    snapshot_download(hub_id, repo_type="dataset", revision=commit, allow_patterns=[*patterns, "README.md"],
                      local_dir=out)
    record = {"hub_id": hub_id, "subset": subset, "split": split, "revision": commit,
              "requested_revision": revision, "patterns": patterns}
    _write_json(out / RECORD.format(subset=subset or "default"), record)
    return record


def read_record(folder: str | Path, subset: str | None) -> dict | None:
    """The download record of ``subset`` in ``folder``, or None when it was never fetched there."""
    path = Path(folder) / RECORD.format(subset=subset or "default")
    return json.loads(path.read_text()) if path.is_file() else None


def _write_json(path: Path, value: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hub-id", required=True, help="dataset repo, ORG/NAME")
    p.add_argument("--subset", help="the config (required when the card has several and no default)")
    p.add_argument("--split", default="train")
    p.add_argument("--revision", help="a commit (pin it), branch or tag; default: the main branch's commit")
    p.add_argument("--out", type=Path, required=True, help="local folder (the same one for every config)")
    a = p.parse_args(argv)
    try:
        record = download(a.hub_id, a.out, a.subset, a.split, a.revision)
    except (DownloadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {a.hub_id} {a.subset or ''} at commit {record['revision']} ({', '.join(record['patterns'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
