"""A source's mixture index, built once and memory-mapped by every rank that reads it.

The mixture (data.mixture) needs, per source, every document's length and, per
epoch, a seeded permutation of the documents with a prefix sum every ``CKPT``
documents. At 2-3 billion documents that is 4 bytes per document for the lengths
plus 4 per document per epoch: tens of GB. Held in each rank's own memory it is
paid 8 times per node; written once as ``.npy`` files and mapped read-only, it
lives once in the page cache and each rank's share of it (its PSS) is 1/ranks.

Where: ``<source>/.index/<key>/`` beside the shards when that folder can be written
(one build for every node that sees the shared file system), else
``$LANEFORMER_INDEX_CACHE`` or ``~/.cache/laneformer/index``, under the same key.
The key is a hash of the source's manifest.json, so re-tokenized shards get a new
index and a stale one is never read. Files are written to a temporary name and
renamed into place (a reader never sees half a file); a lock file makes one rank
per node build while the others wait, and every file is checked against the
manifest (length, total tokens) when it is mapped: a file that does not match is
rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from data.shards import MANIFEST, ShardError, TokenizedSource

CKPT = 64  # one stored prefix sum every CKPT documents
CACHE_ENV = "LANEFORMER_INDEX_CACHE"
_VERSION = 1  # bump when the files' meaning changes


def ckpt_sums(lens: np.ndarray) -> np.ndarray:
    """Start offset of every CKPT-th document, plus the total: ``ckpt_count(len(lens))`` int64."""
    pad = -len(lens) % CKPT
    blocks = np.concatenate([lens, np.zeros(pad, lens.dtype)]).reshape(-1, CKPT).sum(1, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(blocks)])


def ckpt_count(n_docs: int) -> int:
    return -(-n_docs // CKPT) + 1


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def index_dir(source: TokenizedSource) -> Path:
    """This source's index folder: beside the shards if writable, else the node-local cache."""
    manifest = (Path(source.path) / MANIFEST).read_bytes()
    key = f"v{_VERSION}-{hashlib.sha256(manifest).hexdigest()[:16]}"
    beside = Path(source.path) / ".index"
    if _writable(beside):
        return beside / key
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "laneformer" / "index")
    return cache / key


@contextmanager
def _build_lock(folder: Path):
    """One builder at a time per lock file; where the file system has no flock, none (the rename
    still keeps every file whole, ranks may only build the same file twice)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


class SourceIndex:
    """Lengths and epoch permutations of one source, as read-only memory maps."""

    def __init__(self, source: TokenizedSource, folder: Path | None = None):
        self.source = source
        self.folder = folder or index_dir(source)
        self.num_docs = source.num_documents
        self.num_tokens = source.num_tokens
        self.lens = self._mapped("lens.npy", self.num_docs, self._build_lens)
        self.starts = self._mapped("starts.npy", ckpt_count(self.num_docs), lambda: ckpt_sums(self.lens))
        if int(self.starts[-1]) != self.num_tokens:
            raise ShardError(f"{self.folder / 'lens.npy'}: document lengths sum to {int(self.starts[-1])}, "
                             f"{source.path / MANIFEST} lists {self.num_tokens} tokens")

    def epoch(self, key: list[int], e: int) -> tuple[np.ndarray, np.ndarray]:
        """(permutation of the documents for epoch e, stream offset of every CKPT-th permuted document)."""
        stem = f"perm-{'-'.join(f'{k:x}' for k in key)}-e{e}"
        perm = self._mapped(f"{stem}.npy", self.num_docs, lambda: self._build_perm(key, e))
        starts = self._mapped(f"{stem}.starts.npy", ckpt_count(self.num_docs), lambda: ckpt_sums(self.lens[perm]))
        return perm, starts

    def _build_lens(self) -> np.ndarray:
        lens = np.concatenate([np.diff(s.doc_ends.astype(np.int64), prepend=0) for s in self.source.shards])
        if len(lens) and lens.max() >= 2**32:
            raise ShardError(f"{self.source.path}: a document has >= 2**32 tokens")
        return lens.astype(np.uint32)

    def _build_perm(self, key: list[int], e: int) -> np.ndarray:
        perm = np.arange(self.num_docs, dtype=np.uint32 if self.num_docs < 2**32 else np.uint64)
        np.random.default_rng(key + [e]).shuffle(perm)
        return perm

    def _mapped(self, name: str, length: int, build) -> np.ndarray:
        """``name`` mapped read-only; built first (once, under the lock) if missing or not ``length`` long."""
        path = self.folder / name
        if (array := _load(path, length)) is not None:
            return array
        with _build_lock(self.folder):
            if (array := _load(path, length)) is None:  # another rank may have built it meanwhile
                _save_atomic(path, build())
                array = _load(path, length)
        if array is None:
            raise ShardError(f"{path}: written but unreadable or not {length} entries long")
        return array


def _load(path: Path, length: int) -> np.ndarray | None:
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    return array if array.ndim == 1 and len(array) == length else None


def _save_atomic(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.ascontiguousarray(array))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
