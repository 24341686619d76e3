"""Preference pairs as batches, and their torchtitan data loader (as data.mixture and data.loader are
the mixture's): which pairs a rank reads at each micro batch, and their rows.

A pair source (data.pairs, which checks it: ``open_pairs``) is an ordinary tokenized source whose
``manifest.json`` has a ``pairs`` entry: document ``2p`` is pair p's chosen conversation, ``2p + 1``
its rejected one, adjacent in one shard, each ``<s> prompt answer </s>`` with the loss mask on the
answer's tokens only. Several pair sources are one table of pairs: source by source, pair ids counting
on, drawn uniformly (so a source's share is its share of the pairs: the recipe's ``[data]`` refuses
unequal weights rather than ignore them).

Order: epoch e visits every pair once, in a permutation seeded by (seed, e). The loader's state is
one number, the next global sequence index (two per pair), identical on every rank: data-parallel
rank r of W reads the pairs ``next/2 + r * k + j`` (j < k, k = micro batch / 2), as
``data.mixture.MixtureLoader`` reads samples, so a run resumes on any world size with the pairs
the uninterrupted run would have read, and a spike rollback's ``skip_to`` works in the same units.

Rows: a micro batch of k pairs is ``[chosen_0 .. chosen_{k-1}, rejected_0 .. rejected_{k-1}]``, one
sequence a row, padded to ``seq_len`` (open-instruct's ``concatenated_inputs``: chosen and rejected
in one forward). Labels are the next token where the mask says answer, else IGNORE_INDEX (padding
too); positions count from 0 in the sequence and again from 0 in its padding, so the padding is a
document of its own that no answer token attends to (the model's document mask).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.components.dataloader import BaseDataLoader

from data.loader import BatchLoaderSlot, SentencePieceTokenizer
from data.mixture import IGNORE_INDEX
from data.pairs import PairError, open_pairs
from data.shards import TokenizedSource

PAIR_IDS = "pair_ids"  # the batch's key for its pairs' ids (taken out before the model's forward)


class PairSet:
    """Every pair of the given pair sources, by id."""

    def __init__(self, paths: Sequence[str | Path], seq_len: int, fingerprint: str | None = None,
                 vocab_size: int | None = None):
        self.paths, self.seq_len = [str(p) for p in paths], seq_len
        self.sources: list[TokenizedSource] = []
        shard_of, first_doc, names = [], [], []
        for s, path in enumerate(self.paths):
            source = open_pairs(path, fingerprint, vocab_size)
            for k, shard in enumerate(source.shards):
                lengths = np.diff(np.concatenate([[0], np.asarray(shard.doc_ends, dtype=np.int64)]))
                if (too_long := np.flatnonzero(lengths - 1 > seq_len)).size:
                    d = int(too_long[0])
                    raise PairError(f"{shard.path}: pair {d // 2} of the shard ({'chosen' if d % 2 == 0 else 'rejected'}, "
                                    f"document {d}) has {lengths[d]} tokens, over seq_len {seq_len} + 1")
                n = shard.num_documents // 2
                shard_of.append(np.full(n, k, dtype=np.int64))
                first_doc.append(np.arange(n, dtype=np.int64) * 2)
                names.append(np.full(n, s, dtype=np.int64))
            self.sources.append(source)
        self._source = np.concatenate(names)
        self._shard = np.concatenate(shard_of)
        self._doc = np.concatenate(first_doc)

    def __len__(self) -> int:
        return len(self._doc)

    def describe(self, pair: int) -> str:
        """A pair's place on disk, for error messages."""
        s, k, d = int(self._source[pair]), int(self._shard[pair]), int(self._doc[pair])
        return f"pair {pair} ({self.sources[s].shards[k].path}, documents {d} and {d + 1})"

    def _document(self, pair: int, side: int) -> tuple[np.ndarray, np.ndarray]:
        shard = self.sources[int(self._source[pair])].shards[int(self._shard[pair])]
        d = int(self._doc[pair]) + side
        start = int(shard.doc_ends[d - 1]) if d else 0
        end = int(shard.doc_ends[d])
        return np.asarray(shard.tokens[start:end], dtype=np.int64), np.asarray(shard.loss[start:end])

    def rows(self, pairs: np.ndarray) -> dict[str, np.ndarray]:
        """input_ids, labels, positions [2k, seq_len] int64 for k pairs: chosen rows, then rejected."""
        k, L = len(pairs), self.seq_len
        out = {"input_ids": np.zeros((2 * k, L), np.int64), "labels": np.full((2 * k, L), IGNORE_INDEX, np.int64),
               "positions": np.zeros((2 * k, L), np.int64)}
        for side in (0, 1):
            for j, pair in enumerate(pairs):
                tokens, mask = self._document(int(pair), side)
                row, n = side * k + j, len(tokens) - 1
                if not mask[1:].any():
                    raise PairError(f"{self.describe(int(pair))}: the {('chosen', 'rejected')[side]} answer has no "
                                    "token in the loss mask")
                out["input_ids"][row, :n] = tokens[:-1]
                out["labels"][row, :n] = np.where(mask[1:] == 1, tokens[1:], IGNORE_INDEX)
                out["positions"][row, :n] = np.arange(n)
                out["positions"][row, n:] = np.arange(L - n)
        return out


class PairLoader:
    """One data-parallel rank's micro batches of pairs (see the module's docstring for the order)."""

    def __init__(self, pairs: PairSet, local_batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if local_batch_size % 2:
            raise PairError(f"micro batch {local_batch_size}: a preference micro batch holds whole pairs "
                            "(two sequences each), so it must be even")
        self.pairs, self.seed, self.rank, self.world_size = pairs, seed, rank, world_size
        self.local_pairs = local_batch_size // 2
        self.next_index = 0  # the next global sequence index: 2 x the next global pair
        self.skipped: list[tuple[int, int]] = []
        self._epoch: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """Pair ids in epoch ``epoch``'s order."""
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs)))
        return self._epoch[1]

    def pair_ids(self, first: int, count: int) -> np.ndarray:
        """The ids of global pairs ``first .. first + count - 1`` (across epochs)."""
        n = len(self.pairs)
        index = np.arange(first, first + count, dtype=np.int64)
        return np.array([self.order(int(i // n))[int(i % n)] for i in index], dtype=np.int64)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        first = self.next_index // 2 + self.rank * self.local_pairs
        ids = self.pair_ids(first, self.local_pairs)
        self.next_index += 2 * self.local_pairs * self.world_size
        return {**self.pairs.rows(ids), PAIR_IDS: ids}

    def skip_to(self, index: int) -> tuple[int, int]:
        """Go on from global sequence ``index`` (a spike rollback; ``MixtureLoader.skip_to``)."""
        skipped = (self.next_index, int(index))
        self.skipped.append(skipped)
        self.next_index = int(index)
        return skipped

    def state_dict(self) -> dict:
        return {"next_index": self.next_index, "seed": self.seed, "pairs": len(self.pairs),
                "skipped": json.dumps(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["pairs"] != len(self.pairs):
            raise PairError(f"checkpoint was written for {state['pairs']} pairs with seed {state['seed']}; "
                            f"this run has {len(self.pairs)} pairs with seed {self.seed}")
        self.next_index = int(state["next_index"])
        self.skipped = [tuple(r) for r in json.loads(state.get("skipped", "[]"))]


class PairDataLoader(BatchLoaderSlot):
    """torchtitan's data loader slot for a preference run: ``({"input", "positions", "pair_ids"}, labels)``."""

    INPUTS = {**BatchLoaderSlot.INPUTS, PAIR_IDS: PAIR_IDS}  # the pair ids, for the reference log-probs

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        sources: list[str] = field(default_factory=list)  # the pair sources' dirs
        vocab_size: int = 0
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: SentencePieceTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any):
        pairs = PairSet(config.sources, seq_len, tokenizer.tokenizer.fingerprint, config.vocab_size)
        self.loader = PairLoader(pairs, local_batch_size, config.seed, dp_rank, dp_world_size)
