"""A source's held-out documents: chosen by a hash of each document, written as their own source.

    python -m data.held_out DIR [DIR ...] --held-out 0.001     # a fraction of the documents
    python -m data.held_out DIR --held-out 2000                # or a number of documents
    python -m train.data held-out --recipe phase1 [--source S] # every source of a recipe, at its [data] held_out

The rule: a document is held out when the key of its token ids, the first 8 bytes of
BLAKE2b (hashlib) over the ids as little-endian uint32, read as a little-endian integer, is
below a threshold: ``floor(fraction x 2**64)`` for a fraction, or one above the ``count``-th
smallest key for a count. The key depends on the document's ids alone, so the same documents
are held out however the source is sharded, in whatever order, and when it is tokenized again
with the same tokenizer; an exact duplicate of a held-out document is held out with it (a
count may then hold out a few more documents than asked). The ids rather than the text are
hashed so that one rule serves both paths: ``data.tokenize --held-out`` splits the shards it
has just written, and this command splits shards tokenized long ago, with no re-tokenization.

A split moves the held-out documents of every shard ``<dir>/NNNNN_unshuffled.ds`` into
``<dir>/held_out/NNNNN_unshuffled.ds`` (with their ``.index``, ``.metadata`` and chat
``.ds.loss``), rewrites the training shards without them, and writes both manifests: the
held-out set is a tokenized source of its own (``held_out/manifest.json``), which the
training mixture never opens (it reads only the shards its own manifest lists), and the
source's manifest records the rule under ``held_out``. The source's shards, checksums and
manifest (so its mixture index, data.index) change: a run that had started on the unsplit
source reads other batches if it resumes on the split one.

A second split with the same setting changes nothing, once it has checked that no training shard
holds a held-out document (by key: a shard written again after the split would); another setting is
refused (tokenize again to change it). Keys are held in memory, 8 bytes a document. A split rewrites each
shard under a temporary name and renames it into place; one interrupted during its renames
leaves a source that ``python -m data.verify`` refuses: tokenize it again.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path

import numpy as np

from data.pairs import MANIFEST_KEY as PAIRS
from data.shards import MANIFEST, Shard, ShardError, load_manifest, open_shard, write_manifest

HELD_OUT_DIR = "held_out"  # inside a source's dir: its held-out documents, a tokenized source of their own
# A source split before laneformer 0.2 holds them in OLD_DIR and records the rule under OLD_KEY (entry and
# setting): read as the new names, with a message, until the next release. Nothing is rewritten for it: a
# source's manifest is its fingerprint (data.index), and a run reading it may be resuming.
OLD_DIR, OLD_KEY = "heldout", "holdout"
_said: set[Path] = set()
RULE = "blake2b-8 of the document's token ids (little-endian uint32), as a little-endian integer, < threshold"


class HeldOutError(ValueError):
    """A held_out setting that cannot be applied to a source (names the source and the setting)."""


def held_out_problem(value) -> str | None:
    """Why ``value`` is not a held_out setting (a fraction in (0, 1), a document count >= 1, or 0 for
    none), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a fraction in (0, 1) or a document count >= 1, got {value!r}"
    if isinstance(value, float) and not 0 <= value < 1:
        return f"a fraction must be in (0, 1) (a document count is an integer), got {value!r}"
    if isinstance(value, int) and value < 0:
        return f"a document count must be >= 1 (0: no held_out), got {value!r}"
    return None


def document_key(ids: np.ndarray) -> int:
    """The rule's key of one document (its ids as stored, framing included)."""
    digest = hashlib.blake2b(np.asarray(ids, dtype="<u4").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_keys(shard: Shard) -> np.ndarray:
    return np.array([document_key(shard.document(i)) for i in range(shard.num_documents)], dtype=np.uint64)


def threshold(held_out: float | int, keys: list[np.ndarray]) -> int:
    """Documents whose key is below this are held out."""
    if isinstance(held_out, float):
        return math.floor(held_out * (1 << 64))
    every = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    if held_out >= len(every):
        raise HeldOutError(f"held_out {held_out} documents: the source has only {len(every)}")
    return int(np.partition(every, held_out - 1)[held_out - 1]) + 1


def held_out_dir(source_dir: str | Path) -> Path:
    """``<source>/held_out``; a source split before 0.2 (``OLD_DIR`` only): that, said once a process."""
    new, old = Path(source_dir) / HELD_OUT_DIR, Path(source_dir) / OLD_DIR
    if new.exists() or not old.is_dir():
        return new
    if old not in _said:
        _said.add(old)
        print(f"{old}: split before laneformer 0.2, read as its held_out set (the old name is read until the next "
              f"release; rename it {HELD_OUT_DIR}/ when no run reads it)", file=sys.stderr)
    return old


def recorded_entry(manifest: dict) -> dict | None:
    """A manifest's ``held_out`` entry, the pre-0.2 ``OLD_KEY`` one read as it."""
    entry = manifest.get("held_out", manifest.get(OLD_KEY))
    if entry is None or "held_out" in entry:
        return entry
    return {("held_out" if k == OLD_KEY else k): v for k, v in entry.items()}


def recorded_held_out(source_dir: str | Path) -> dict | None:
    """The ``held_out`` entry of the source's held-out set (its manifest), None when it has none."""
    path = held_out_dir(source_dir)
    return recorded_entry(load_manifest(path)) if (path / MANIFEST).is_file() else None


def _shards(directory: Path, manifest: dict) -> list[Shard]:
    return [open_shard(directory / e["file"], manifest["token_size"], e["tokens"], e["documents"],
                       loss=manifest.get("loss_mask", False)) for e in manifest["shards"]]


def _write_documents(path: Path, shard: Shard, docs: np.ndarray) -> None:
    """Documents ``docs`` of ``shard``, in order, as a shard at ``path`` (datatrove's format), under
    temporary names that ``_commit`` renames into place."""
    ends = shard.doc_ends.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    lens = ends[docs] - starts[docs]
    files = {"": shard.tokens, ".loss": shard.loss} if shard.loss is not None else {"": shard.tokens}
    for suffix, array in files.items():
        with open(f"{path}{suffix}.tmp", "wb") as f:
            for a, b in zip(starts[docs], ends[docs]):  # from the memmap, a document at a time
                f.write(np.asarray(array[a:b]).tobytes())
    np.cumsum(lens, dtype=np.int64).astype("<u8").tofile(f"{path}.index.tmp")
    first = Path(f"{shard.path}.metadata").read_text().split("\n")[0] if Path(f"{shard.path}.metadata").is_file() \
        else "unknown|" + str(shard.tokens.dtype.itemsize)
    Path(f"{path}.metadata.tmp").write_text(f"{first}\n{int(lens.sum())}\n{int(lens.sum())}")


def _commit(path: Path) -> None:
    for suffix in ("", ".index", ".loss", ".metadata"):
        if os.path.exists(f"{path}{suffix}.tmp"):
            os.replace(f"{path}{suffix}.tmp", f"{path}{suffix}")


def check_kept_out(directory: Path, manifest: dict) -> None:
    """A re-run's check that the split still holds: no training shard holds a document whose key is a held-out
    document's. Shards written again after the split (a tokenization into the same dir) would otherwise
    train on the held-out set while ``held_out/`` still says it is held out. Reads every document, as the
    split did."""
    held_dir = held_out_dir(directory)
    held = np.concatenate([shard_keys(s) for s in _shards(held_dir, load_manifest(held_dir))])
    for shard in _shards(directory, manifest):
        leaked = np.flatnonzero(np.isin(shard_keys(shard), held))
        if leaked.size:
            raise HeldOutError(f"{directory}: held_out: {shard.path} holds {leaked.size} held-out document(s) of "
                               f"{held_dir} (first: its document {leaked[0]}): the shard was written again after "
                               "the split; tokenize the source again into an empty dir")


_MANIFEST_OWN = ("format", "tokenizer", "token_size", "dtype", "loss_mask", "num_tokens", "num_documents",
                 "shards", "input")  # what write_manifest computes; every other key is carried over


def split(directory: str | Path, held_out: float | int) -> dict:
    """Hold out ``held_out`` (a fraction or a count) of the source in ``directory``; returns the
    ``held_out`` entry both manifests record. Idempotent for the same setting."""
    directory = Path(directory)
    if why := held_out_problem(held_out):
        raise HeldOutError(f"{directory}: held_out: {why}")
    manifest = load_manifest(directory)
    if PAIRS in manifest:  # a hash of single documents would part a pair's chosen from its rejected
        raise HeldOutError(f"{directory}: held_out: a preference-pair source; hold pairs out in a file of their own")
    entry = recorded_held_out(directory)
    if entry is not None:
        if entry["held_out"] != held_out:
            raise HeldOutError(f"{directory}: already split with held_out {entry['held_out']!r} ("
                               f"{held_out_dir(directory) / MANIFEST}), not {held_out!r}: tokenize it again to change it")
        check_kept_out(directory, manifest)
        if recorded_entry(manifest) != entry:  # tokenization rerun: its manifest was rewritten from the shards
            _rewrite(directory, manifest, entry)
        return entry
    if held_out == 0:
        raise HeldOutError(f"{directory}: held_out 0 holds out nothing")
    shards = _shards(directory, manifest)
    keys = [shard_keys(s) for s in shards]
    below = threshold(held_out, keys)
    held = [k <= np.uint64(below - 1) if below > 0 else np.zeros(len(k), bool) for k in keys]
    n_held, n_docs = sum(int(h.sum()) for h in held), sum(len(k) for k in keys)
    if n_held == 0:
        raise HeldOutError(f"{directory}: held_out {held_out!r} selects none of its {n_docs} documents: give a larger "
                           "fraction or a document count")
    if n_held == n_docs:
        raise HeldOutError(f"{directory}: held_out {held_out!r} selects all of its {n_docs} documents")
    out = held_out_dir(directory)
    out.mkdir(exist_ok=True)
    for shard, h in zip(shards, held):
        if h.any():
            _write_documents(out / shard.path.name, shard, np.flatnonzero(h))
            _write_documents(shard.path, shard, np.flatnonzero(~h))
    for shard, h in zip(shards, held):  # every shard is written before any is replaced
        if h.any():
            _commit(out / shard.path.name)
            _commit(shard.path)
    tokens = sum(int(np.diff(s.doc_ends.astype(np.int64), prepend=0)[h].sum()) for s, h in zip(shards, held))
    entry = {"rule": RULE, "held_out": held_out, "threshold": below, "documents": n_held, "tokens": tokens}
    carried = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN and k not in ("held_out", OLD_KEY)}
    write_manifest(out, manifest["tokenizer"], {"kind": "held_out", "of": str(directory.name),
                                                "input": manifest["input"]}, {**carried, "held_out": entry})
    _rewrite(directory, manifest, entry)
    return entry


def _rewrite(directory: Path, manifest: dict, entry: dict) -> None:
    """The source's manifest, from its shards as they are now, with the held_out entry."""
    carried = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN and k not in ("held_out", OLD_KEY)}
    write_manifest(directory, manifest["tokenizer"], manifest["input"], {**carried, "held_out": entry})


def parse_held_out(text: str) -> float | int:
    """``--held-out``'s value: an integer is a document count, anything else a fraction."""
    try:
        value = int(text) if text.strip().lstrip("+").isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction or a document count") from None
    if why := held_out_problem(value):
        raise argparse.ArgumentTypeError(why)
    return value


class _OldFlag(argparse.Action):
    """``--`` + ``OLD_KEY``: read as ``--held-out``, with a message, until the next release."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{option_string}: renamed --held-out in laneformer 0.2; read as --held-out {values} (the old name is "
              "read until the next release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_held_out_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--held-out F|N`` (into ``held_out``), and the pre-0.2 flag (``OLD_KEY``) unlisted."""
    parser.add_argument("--held-out", type=parse_held_out, help=help)
    parser.add_argument("--" + OLD_KEY, dest="held_out", type=parse_held_out, action=_OldFlag, help=argparse.SUPPRESS)


def describe(directory: Path, entry: dict) -> str:
    return (f"{held_out_dir(directory)}: {entry['documents']:,} documents, {entry['tokens']:,} tokens held out "
            f"(held_out {entry['held_out']!r})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.held_out", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="tokenized sources (data.tokenize's output)")
    add_held_out_flag(p, "a fraction of the documents (0.001) or a number of documents (2000); required")
    a = p.parse_args(argv)
    if a.held_out is None:
        p.error("the following arguments are required: --held-out")
    for directory in a.dirs:
        try:
            print(describe(directory, split(directory, a.held_out)))
        except (ShardError, HeldOutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
