"""A source's held-out documents: chosen by a hash of each document, written as their own source.

    python -m data.holdout DIR [DIR ...] --holdout 0.001     # a fraction of the documents
    python -m data.holdout DIR --holdout 2000                # or a number of documents
    python -m train.data holdout --recipe phase1 [--source S] # every source of a recipe, at its [data] holdout

The rule: a document is held out when the key of its token ids, the first 8 bytes of
BLAKE2b (hashlib) over the ids as little-endian uint32, read as a little-endian integer, is
below a threshold: ``floor(fraction x 2**64)`` for a fraction, or one above the ``count``-th
smallest key for a count. The key depends on the document's ids alone, so the same documents
are held out however the source is sharded, in whatever order, and when it is tokenized again
with the same tokenizer; an exact duplicate of a held-out document is held out with it (a
count may then hold out a few more documents than asked). The ids rather than the text are
hashed so that one rule serves both paths: ``data.tokenize --holdout`` splits the shards it
has just written, and this command splits shards tokenized long ago, with no re-tokenization.

A split moves the held-out documents of every shard ``<dir>/NNNNN_unshuffled.ds`` into
``<dir>/heldout/NNNNN_unshuffled.ds`` (with their ``.index``, ``.metadata`` and chat
``.ds.loss``), rewrites the training shards without them, and writes both manifests: the
held-out set is a tokenized source of its own (``heldout/manifest.json``), which the
training mixture never opens (it reads only the shards its own manifest lists), and the
source's manifest records the rule under ``holdout``. The source's shards, checksums and
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

HELD_OUT_DIR = "heldout"  # inside a source's dir: its held-out documents, a tokenized source of their own
RULE = "blake2b-8 of the document's token ids (little-endian uint32), as a little-endian integer, < threshold"


class HoldoutError(ValueError):
    """A holdout setting that cannot be applied to a source (names the source and the setting)."""


def holdout_problem(value) -> str | None:
    """Why ``value`` is not a holdout setting (a fraction in (0, 1), a document count >= 1, or 0 for
    none), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a fraction in (0, 1) or a document count >= 1, got {value!r}"
    if isinstance(value, float) and not 0 <= value < 1:
        return f"a fraction must be in (0, 1) (a document count is an integer), got {value!r}"
    if isinstance(value, int) and value < 0:
        return f"a document count must be >= 1 (0: no holdout), got {value!r}"
    return None


def document_key(ids: np.ndarray) -> int:
    """The rule's key of one document (its ids as stored, framing included)."""
    digest = hashlib.blake2b(np.asarray(ids, dtype="<u4").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_keys(shard: Shard) -> np.ndarray:
    return np.array([document_key(shard.document(i)) for i in range(shard.num_documents)], dtype=np.uint64)


def threshold(holdout: float | int, keys: list[np.ndarray]) -> int:
    """Documents whose key is below this are held out."""
    if isinstance(holdout, float):
        return math.floor(holdout * (1 << 64))
    every = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    if holdout >= len(every):
        raise HoldoutError(f"holdout {holdout} documents: the source has only {len(every)}")
    return int(np.partition(every, holdout - 1)[holdout - 1]) + 1


def held_out_dir(source_dir: str | Path) -> Path:
    return Path(source_dir) / HELD_OUT_DIR


def recorded_holdout(source_dir: str | Path) -> dict | None:
    """The ``holdout`` entry of the source's held-out set (its manifest), None when it has none."""
    path = held_out_dir(source_dir)
    return load_manifest(path).get("holdout") if (path / MANIFEST).is_file() else None


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
    train on the held-out set while ``heldout/`` still says it is held out. Reads every document, as the
    split did."""
    held_dir = held_out_dir(directory)
    held = np.concatenate([shard_keys(s) for s in _shards(held_dir, load_manifest(held_dir))])
    for shard in _shards(directory, manifest):
        leaked = np.flatnonzero(np.isin(shard_keys(shard), held))
        if leaked.size:
            raise HoldoutError(f"{directory}: holdout: {shard.path} holds {leaked.size} held-out document(s) of "
                               f"{held_dir} (first: its document {leaked[0]}): the shard was written again after "
                               "the split; tokenize the source again into an empty dir")


_MANIFEST_OWN = ("format", "tokenizer", "token_size", "dtype", "loss_mask", "num_tokens", "num_documents",
                 "shards", "input")  # what write_manifest computes; every other key is carried over


def split(directory: str | Path, holdout: float | int) -> dict:
    """Hold out ``holdout`` (a fraction or a count) of the source in ``directory``; returns the
    ``holdout`` entry both manifests record. Idempotent for the same setting."""
    directory = Path(directory)
    if why := holdout_problem(holdout):
        raise HoldoutError(f"{directory}: holdout: {why}")
    manifest = load_manifest(directory)
    if PAIRS in manifest:  # a hash of single documents would part a pair's chosen from its rejected
        raise HoldoutError(f"{directory}: holdout: a preference-pair source; hold pairs out in a file of their own")
    entry = recorded_holdout(directory)
    if entry is not None:
        if entry["holdout"] != holdout:
            raise HoldoutError(f"{directory}: already split with holdout {entry['holdout']!r} ("
                               f"{held_out_dir(directory) / MANIFEST}), not {holdout!r}: tokenize it again to change it")
        check_kept_out(directory, manifest)
        if manifest.get("holdout") != entry:  # tokenization rerun: its manifest was rewritten from the shards
            _rewrite(directory, manifest, entry)
        return entry
    if holdout == 0:
        raise HoldoutError(f"{directory}: holdout 0 holds out nothing")
    shards = _shards(directory, manifest)
    keys = [shard_keys(s) for s in shards]
    below = threshold(holdout, keys)
    held = [k <= np.uint64(below - 1) if below > 0 else np.zeros(len(k), bool) for k in keys]
    n_held, n_docs = sum(int(h.sum()) for h in held), sum(len(k) for k in keys)
    if n_held == 0:
        raise HoldoutError(f"{directory}: holdout {holdout!r} selects none of its {n_docs} documents: give a larger "
                           "fraction or a document count")
    if n_held == n_docs:
        raise HoldoutError(f"{directory}: holdout {holdout!r} selects all of its {n_docs} documents")
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
    entry = {"rule": RULE, "holdout": holdout, "threshold": below, "documents": n_held, "tokens": tokens}
    carried = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN and k != "holdout"}
    write_manifest(out, manifest["tokenizer"], {"kind": "holdout", "of": str(directory.name),
                                                "input": manifest["input"]}, {**carried, "holdout": entry})
    _rewrite(directory, manifest, entry)
    return entry


def _rewrite(directory: Path, manifest: dict, entry: dict) -> None:
    """The source's manifest, from its shards as they are now, with the holdout entry."""
    carried = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN and k != "holdout"}
    write_manifest(directory, manifest["tokenizer"], manifest["input"], {**carried, "holdout": entry})


def parse_holdout(text: str) -> float | int:
    """``--holdout``'s value: an integer is a document count, anything else a fraction."""
    try:
        value = int(text) if text.strip().lstrip("+").isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction or a document count") from None
    if why := holdout_problem(value):
        raise argparse.ArgumentTypeError(why)
    return value


def describe(directory: Path, entry: dict) -> str:
    return (f"{held_out_dir(directory)}: {entry['documents']:,} documents, {entry['tokens']:,} tokens held out "
            f"(holdout {entry['holdout']!r})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.holdout", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="tokenized sources (data.tokenize's output)")
    p.add_argument("--holdout", required=True, type=parse_holdout,
                   help="a fraction of the documents (0.001) or a number of documents (2000)")
    a = p.parse_args(argv)
    for directory in a.dirs:
        try:
            print(describe(directory, split(directory, a.holdout)))
        except (ShardError, HoldoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
