"""Tokenized sources on disk: datatrove token shards plus this project's manifest.json.

A tokenized source is one directory written by data.tokenize:

    <dir>/NNNNN_unshuffled.ds           little-endian token ids, uint16 (uint32 if vocab > 65536)
    <dir>/NNNNN_unshuffled.ds.index     uint64 cumulative document ends (last == token count)
    <dir>/NNNNN_unshuffled.ds.metadata  "tokenizer|token_size", token count, human count
    <dir>/NNNNN_unshuffled.ds.loss      chat sources only: one byte per token, 1 = trained on (loss mask)
    <dir>/manifest.json                 what the loader checks before training (see write_manifest)
    <dir>/logs/                         datatrove's logging dir: stats, completions (a rerun skips those tasks)

Documents are framed ``<s> text </s>`` (data.tokenizer.FRAMING). Everything here
reads through numpy memmaps, and every check raises an error naming the file, so
a bad shard fails at startup and not hours into a run.

The manifest also counts the documents of at least 4k, 8k, 16k and 32k tokens and their
tokens (``long_documents``): packed samples of a long context are only as long-range as
the documents in them, so a mix meant for a 16k phase must hold documents that long.

The manifest records a BLAKE2b checksum of every .ds, .ds.index (and .ds.loss) file
(hashlib: the standard library has it, datatrove brings no faster hash).
Training only checks sizes at open, which is instant; ``python -m data.verify``
reads every byte against the checksums, for after a copy or a disk incident.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.tokenizer import FRAMING

MANIFEST = "manifest.json"
LOGS_DIR = "logs"  # datatrove's logging dir in a tokenized source's dir (its stats, completions; chat refusals)
FORMAT = "laneformer-tokens/1"
_FRAMING_PROBES = 1024  # documents per shard whose BOS/EOS framing is checked
_CHUNK = 1 << 22
# Document lengths the manifest counts (long_documents): Laneformer's trained context (4,096, spec section 1)
# and the lengths a long-context phase extends it to (issue 44: 16k, then 32k).
LONG_DOCUMENTS = (4096, 8192, 16384, 32768)
_HASH_BLOCK = 1 << 24


class ShardError(ValueError):
    """A tokenized source or shard is missing, truncated, corrupt or incompatible."""


def token_dtype(token_size: int) -> np.dtype:
    if token_size not in (2, 4):
        raise ShardError(f"unsupported token size {token_size} (expected 2 or 4 bytes)")
    return np.dtype("<u2") if token_size == 2 else np.dtype("<u4")


@dataclass
class Shard:
    """One .ds file and its document index, memory-mapped."""

    path: Path
    tokens: np.ndarray  # memmap of token ids
    doc_ends: np.ndarray  # memmap of uint64 cumulative document ends
    loss: np.ndarray | None = None  # memmap of uint8 loss mask per token (chat sources), else None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_documents(self) -> int:
        return len(self.doc_ends)

    def document(self, i: int) -> np.ndarray:
        start = int(self.doc_ends[i - 1]) if i > 0 else 0
        return np.asarray(self.tokens[start : int(self.doc_ends[i])])


def open_shard(path: str | Path, token_size: int, expected_tokens: int | None = None,
               expected_documents: int | None = None, loss: bool = False) -> Shard:
    """Open and check one shard: file sizes agree with index, metadata and manifest."""
    path = Path(path)
    index_path = Path(f"{path}.index")
    for p in (path, index_path):
        if not p.is_file():
            raise ShardError(f"missing shard file: {p}")
    n_bytes = path.stat().st_size
    if n_bytes % token_size:
        raise ShardError(f"truncated shard {path}: {n_bytes} bytes is not a whole number of {token_size}-byte tokens")
    n_tokens = n_bytes // token_size
    idx_bytes = index_path.stat().st_size
    if idx_bytes % 8:
        raise ShardError(f"corrupt index {index_path}: {idx_bytes} bytes is not a whole number of uint64 offsets")
    doc_ends = np.memmap(index_path, dtype="<u8", mode="r") if idx_bytes else np.zeros(0, "<u8")
    if expected_documents is not None and len(doc_ends) != expected_documents:
        raise ShardError(f"corrupt index {index_path}: {len(doc_ends)} documents, manifest says {expected_documents}")
    for lo in range(0, len(doc_ends), _CHUNK):  # in chunks: indexes of big shards stay on disk
        ends = np.asarray(doc_ends[max(lo - 1, 0) : lo + _CHUNK], dtype=np.int64)
        if (lo == 0 and ends[0] <= 0) or np.any(np.diff(ends) <= 0):
            raise ShardError(f"corrupt index {index_path}: document ends are not strictly increasing")
    indexed = int(doc_ends[-1]) if len(doc_ends) else 0
    for what, count in (("its index", indexed), ("the manifest", expected_tokens), ("its .metadata", _metadata_tokens(path))):
        if count is not None and count != n_tokens:
            kind = "truncated shard" if n_tokens < count else "shard size mismatch"
            raise ShardError(f"{kind} {path}: {n_tokens} tokens on disk ({n_bytes} bytes), {what} says {count}")
    tokens = np.memmap(path, dtype=token_dtype(token_size), mode="r") if n_tokens else np.zeros(0, token_dtype(token_size))
    mask = None
    if loss:  # datatrove's .ds.loss: one byte per token
        loss_path = Path(f"{path}.loss")
        if not loss_path.is_file():
            raise ShardError(f"missing loss mask {loss_path} (the manifest says the source has masks)")
        if loss_path.stat().st_size != n_tokens:
            raise ShardError(f"loss mask size mismatch {loss_path}: {loss_path.stat().st_size} bytes, {n_tokens} tokens")
        mask = np.memmap(loss_path, dtype=np.uint8, mode="r") if n_tokens else np.zeros(0, np.uint8)
    return Shard(path, tokens, doc_ends, mask)


def _metadata_tokens(path: Path) -> int | None:
    meta = Path(f"{path}.metadata")
    if not meta.is_file():
        return None
    lines = meta.read_text().splitlines()
    try:
        return int(lines[1])
    except (IndexError, ValueError):
        raise ShardError(f"corrupt metadata {meta}: second line must be the token count") from None


def check_framing(shard: Shard, bos_id: int, eos_id: int, probes: int = _FRAMING_PROBES) -> None:
    """Spot-check that documents start with BOS and end with EOS (evenly spaced probes)."""
    if not shard.num_documents:
        return
    docs = np.unique(np.linspace(0, shard.num_documents - 1, min(probes, shard.num_documents)).astype(np.int64))
    ends = shard.doc_ends[docs].astype(np.int64)
    starts = np.where(docs > 0, shard.doc_ends[np.maximum(docs - 1, 0)].astype(np.int64), 0)
    bad_bos = docs[shard.tokens[starts] != bos_id]
    bad_eos = docs[shard.tokens[ends - 1] != eos_id]
    if len(bad_bos) or len(bad_eos):
        d = int(bad_bos[0]) if len(bad_bos) else int(bad_eos[0])
        raise ShardError(f"{shard.path}: document {d} is not framed as <s> ... </s> (BOS={bos_id}, EOS={eos_id}); "
                         "re-tokenize with data.tokenize")


@dataclass
class TokenizedSource:
    """A validated tokenized directory: its manifest and its non-empty shards."""

    path: Path
    manifest: dict
    shards: list[Shard] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)


def load_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ShardError(f"manifest not found: {path} (tokenize the source with `python -m data.tokenize`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ShardError(f"corrupt manifest {path}: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def open_source(directory: str | Path, expected_fingerprint: str | None = None,
                expected_vocab_size: int | None = None, check_docs: bool = True) -> TokenizedSource:
    """Open a tokenized directory, checking tokenizer, framing and every shard listed."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    mpath = directory / MANIFEST
    tok = manifest["tokenizer"]
    if expected_fingerprint is not None and tok["fingerprint"] != expected_fingerprint:
        raise ShardError(f"{mpath}: shards were made with tokenizer {tok['fingerprint'][:16]}… "
                         f"({tok.get('path')}), expected {expected_fingerprint[:16]}…")
    if expected_vocab_size is not None and tok["vocab_size"] != expected_vocab_size:
        raise ShardError(f"{mpath}: vocab_size {tok['vocab_size']} != expected {expected_vocab_size}")
    if tok.get("framing") != FRAMING:
        raise ShardError(f"{mpath}: framing {tok.get('framing')!r}, the loader expects {FRAMING!r}")
    shards = []
    for entry in manifest["shards"]:
        shard = open_shard(directory / entry["file"], manifest["token_size"], entry["tokens"], entry["documents"],
                           loss=manifest.get("loss_mask", False))
        if shard.num_documents:
            if check_docs:
                check_framing(shard, tok["bos_id"], tok["eos_id"])
            shards.append(shard)
    source = TokenizedSource(directory, manifest, shards)
    if source.num_tokens == 0:
        raise ShardError(f"empty source {directory}: {mpath} lists no documents")
    return source


def long_documents(shards: list[Shard]) -> dict[str, dict[str, int]]:
    """``{"4096": {"documents", "tokens"}, ...}``: how many documents have at least each of LONG_DOCUMENTS
    tokens, and how many tokens those documents hold (read from the indexes, in chunks)."""
    counts = {str(n): {"documents": 0, "tokens": 0} for n in LONG_DOCUMENTS}
    for shard in shards:
        for lo in range(0, shard.num_documents, _CHUNK):
            ends = np.asarray(shard.doc_ends[max(lo - 1, 0) : lo + _CHUNK], dtype=np.int64)
            lens = np.diff(ends, prepend=0) if lo == 0 else np.diff(ends)
            for n in LONG_DOCUMENTS:
                long = lens[lens >= n]
                counts[str(n)]["documents"] += len(long)
                counts[str(n)]["tokens"] += int(long.sum())
    return counts


def describe_long_documents(manifest: dict) -> str:
    """The manifest's ``long_documents`` in a line: tokens in documents of at least 4k, 8k, ... and their
    share of the source (what a long-context mix is for), or why it has none."""
    if "long_documents" not in manifest:
        return "long documents not counted (tokenized before laneformer 0.2: tokenize again to count them)"
    total = max(manifest["num_tokens"], 1)
    return "tokens in documents of at least " + ", ".join(
        f"{int(n) // 1024}k: {c['tokens']:,} ({c['tokens'] / total:.1%})" for n, c in manifest["long_documents"].items())


def write_manifest(directory: str | Path, tokenizer: dict, input_description: dict, extra: dict | None = None) -> dict:
    """Scan the shards in directory, check them, and write manifest.json (returned).

    tokenizer: {"path", "fingerprint", "vocab_size", "bos_id", "eos_id"}; the
    framing is added here, since only data.tokenize writes shards. ``extra``'s keys
    are added; ``long_documents`` is counted again whatever ``extra`` carries.
    """
    directory = Path(directory)
    token_size = 2 if tokenizer["vocab_size"] <= 65536 else 4
    entries, n_tokens, n_docs, shards = [], 0, 0, []
    paths = sorted(directory.glob("*.ds"))
    has_loss = {Path(f"{p}.loss").is_file() for p in paths}
    if len(has_loss) > 1:
        raise ShardError(f"{directory}: some shards have a .ds.loss mask and some do not")
    loss = has_loss == {True}
    for path in paths:
        shard = open_shard(path, token_size, loss=loss)
        entries.append({"file": path.name, "bytes": path.stat().st_size,
                        "tokens": shard.num_tokens, "documents": shard.num_documents,
                        "blake2b": checksum(path), "index_blake2b": checksum(Path(f"{path}.index")),
                        **({"loss_blake2b": checksum(Path(f"{path}.loss"))} if loss else {})})
        n_tokens += shard.num_tokens
        n_docs += shard.num_documents
        shards.append(shard)
    manifest = {
        "format": FORMAT,
        "tokenizer": {**tokenizer, "framing": FRAMING},
        "token_size": token_size,
        "dtype": token_dtype(token_size).name,
        "loss_mask": loss,  # every shard has a .ds.loss (chat sources); the loader masks labels with it
        "num_tokens": n_tokens,
        "num_documents": n_docs,
        "shards": entries,
        "input": input_description,
        **(extra or {}),
        "long_documents": long_documents(shards),  # after extra: a rewrite (data.held_out) carries the old one
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def checksum(path: str | Path, bar=None) -> str:
    """Hex BLAKE2b-128 of a file's bytes, read in 16 MiB blocks (``bar.update(bytes)`` after each)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    return h.hexdigest()


def verify_checksums(directory: str | Path, bar=None) -> TokenizedSource:
    """Open a source (sizes, index, framing) and check every shard and index file against
    the checksums in its manifest; a ShardError names the first file that differs.
    ``bar``: a progress counter, updated with the bytes read."""
    source = open_source(directory, check_docs=True)
    mpath = Path(directory) / MANIFEST
    for entry in source.manifest["shards"]:
        if "blake2b" not in entry or "index_blake2b" not in entry:
            raise ShardError(f"{mpath}: no checksum for {entry['file']} (written before checksums existed; "
                             "`python -m data.tokenize --manifest-only` records them for the shards as they are now)")
        path = Path(directory) / entry["file"]
        files = [(path, entry["blake2b"]), (Path(f"{path}.index"), entry["index_blake2b"])]
        if source.manifest.get("loss_mask"):
            files.append((Path(f"{path}.loss"), entry.get("loss_blake2b")))
        for file, expected in files:
            if (actual := checksum(file, bar)) != expected:
                raise ShardError(f"checksum mismatch {file}: blake2b {actual}, {mpath} says {expected}")
    return source


def write_shard(path: str | Path, documents: list, token_size: int = 2, tokenizer_name: str = "unknown",
                loss: list | None = None) -> None:
    """Write documents (lists/arrays of ids) in datatrove's shard format (tests and tools);
    ``loss``: one 0/1 list per document, written as the .ds.loss mask."""
    path = Path(path)
    arrays = [np.asarray(d, dtype=token_dtype(token_size)) for d in documents]
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, token_dtype(token_size))
    tokens.tofile(path)
    np.cumsum([len(a) for a in arrays], dtype=np.int64).astype("<u8").tofile(f"{path}.index")
    Path(f"{path}.metadata").write_text(f"{tokenizer_name}|{token_size}\n{len(tokens)}\n{len(tokens)}")
    if loss is not None:
        np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss] or [np.zeros(0, np.uint8)]).tofile(f"{path}.loss")
