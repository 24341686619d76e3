"""Deterministic weighted mixture of tokenized sources, packed into fixed-length samples.

Global sample i (seq_len + 1 tokens) is a pure function of (sources, seed, seq_len, i):

1. Schedule: i -> (source s, k-th sample of s). Within each block of `period`
   consecutive indices every source gets a fixed count (largest-remainder
   rounding of weight * period), spread evenly over the block (smooth weighted
   round robin: a source's j-th slot sits at time (j + 0.5) / count). Realized
   shares therefore match the weights to within 1/period plus one sample per
   source over any prefix, and the lookup is O(1).
2. Stream: source s is read as an endless stream of its documents, epoch after
   epoch, each epoch a permutation of all documents seeded by
   (seed, source name, epoch). Sample k of s is the stream window
   [k * seq_len, k * seq_len + seq_len + 1): windows overlap by one token, so
   every token is a label exactly once and documents are packed and cut freely.

Because a sample depends only on its index, data-parallel rank r of W reads
global indices ``next_index + r * (B // W) + j`` (MixtureLoader) and a run can
resume on any world size: the state is one integer, the next global index
(per-source consumed tokens are derived from it, for logging).

Each sample has input_ids, labels (shifted by one) and positions, which restart
at 0 at every document start (and at the start of the sample), so attention
masks can be built per document and RoPE never sees a position >= seq_len.
Labels are not masked: the EOS -> next BOS label is left in (it is trivial).
Sources with a loss mask (chat, data.chat_tokenize) are the exception: a label
whose token has mask 0 (prompt, template markup) becomes IGNORE_INDEX, which
torchtitan's cross-entropy skips and leaves out of its token count, so the
loss is the mean over the answers' tokens. Sources without one mix freely.
A source's ``loss_weight`` (1 by default) makes each of its trained tokens count
that many times in the step's loss (``loss_weights``, a float loss mask:
train.trainer's loss is sum(w x ce) / sum(w)), so a task of a few answer
tokens a sample is not drowned by the language-model tokens beside it.

Memory per source: 4 bytes per document (lengths) plus 4-8 bytes per document
per epoch read (the permutation) and small checkpoint arrays (every _CKPT-th
prefix sum), all in memory-mapped files built once per node (data.index) and
shared by its ranks; tokens are read through numpy memmaps too.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.index import CKPT as _CKPT
from data.held_out import held_out_problem
from data.index import SourceIndex
from data.shards import TokenizedSource, open_source

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX (torch's default), without importing torch
LOSS_WEIGHTS = "loss_weights"  # the batch's per-token loss weights, where a source has a loss_weight
DEFAULT_PERIOD = 1 << 16


class MixtureError(ValueError):
    """The mixture cannot be read as configured (weights, budgets, epochs, exhausted source)."""


@dataclass(frozen=True)
class SourceSpec:
    """One source: a directory made by data.tokenize, with a weight OR a token budget.

    weight: relative share of samples. tokens: absolute budget of training tokens
    (its share is tokens / total planned tokens). max_epochs: how many passes
    over the source's tokens the plan may use (fractions allowed).

    Where its text comes from, for data.download / data.tokenize: ``hub_id`` with
    ``subset`` (the dataset's config), ``split`` and ``revision`` (a pinned commit,
    recorded in the manifest), or ``input``, a local file, folder or glob (bundled
    data); ``text_key`` names the text column, or ``chat_key`` the message list of
    conversations (rendered with the recipe's chat template), or ``pairs`` marks
    preference pairs (data.pairs; rendered with it too, at most ``seq_len`` a side). ``exclude`` drops rows
    whose column holds one of the listed values (``{source = ["..."]}``), at
    tokenization, and is recorded in the manifest. ``expected_tokens``: the source's
    size by its dataset card, so a dry run can size-check the plan before any data
    exists (see ``needs``). ``loss_weight``: how many times each of the source's
    trained tokens counts in the step's loss (sum(w x ce) / sum(w): Megatron's float
    loss mask); the held-out losses stay token means. A recipe's ``[[data.sources]]``
    are these; the values are checked on construction.
    """

    name: str
    path: str | Path  # a tokenized source dir (data.tokenize output)
    weight: float | None = None  # share of the mixture ...
    tokens: int | None = None  # ... or a token budget for this phase
    max_epochs: float = 1.0  # how many times the source may be repeated
    expected_tokens: int | None = None  # the source's size by its card (Llama-2 tokens)
    hub_id: str | None = None
    subset: str | None = None
    split: str = "train"
    revision: str | None = None
    input: str | None = None  # a local file, folder or glob instead of hub_id
    text_key: str = "text"
    chat_key: str | None = None
    pairs: bool = False  # preference pairs (data.pairs): prompt/chosen/rejected rows, two documents each
    expected_pairs: int | None = None  # a pair source's size by its card (rows): a preference run's size check
    exclude: dict[str, list[str]] = field(default_factory=dict)
    # Documents held out of training into <path>/held_out (data.held_out), validated on in the loop: a fraction,
    # a document count, 0 for none; None: the recipe's [data] held_out.
    held_out: int | float | None = None
    decontaminate: list[str] = field(default_factory=list)  # benchmarks whose n-grams drop documents at tokenization
    # Long documents (data.tokenize): keep only documents of at least this many tokens; and one document per
    # value of the concat_by column (a code repository), its rows sorted by concat_order (a file path).
    min_doc_tokens: int | None = None
    concat_by: str | None = None
    concat_order: str | None = None
    loss_weight: float = 1.0

    def __post_init__(self):
        where = f"source {self.name!r} ({self.path})"
        if (self.weight is None) == (self.tokens is None):
            raise MixtureError(f"{where}: give exactly one of weight or tokens")
        if self.weight is not None and not (math.isfinite(self.weight) and self.weight >= 0):
            raise MixtureError(f"{where}: weight must be finite and >= 0, got {self.weight}")
        if self.tokens is not None and self.tokens <= 0:
            raise MixtureError(f"{where}: token budget must be > 0, got {self.tokens}")
        if not (math.isfinite(self.loss_weight) and self.loss_weight > 0):
            raise MixtureError(f"{where}: loss_weight must be finite and > 0, got {self.loss_weight}")
        if self.pairs and self.loss_weight != 1:  # a preference run's loss is per pair (train.preference.loss)
            raise MixtureError(f"{where}: loss_weight: not for pairs (a preference run's loss is a mean over pairs)")
        if not self.max_epochs > 0:
            raise MixtureError(f"{where}: max_epochs must be > 0, got {self.max_epochs}")
        if self.expected_tokens is not None and self.expected_tokens <= 0:
            raise MixtureError(f"{where}: expected_tokens must be > 0, got {self.expected_tokens}")
        if self.expected_pairs is not None and (self.expected_pairs <= 0 or not self.pairs):
            raise MixtureError(f"{where}: expected_pairs must be > 0, on a pairs source; got {self.expected_pairs}")
        if self.hub_id and self.input:
            raise MixtureError(f"{where}: give at most one of hub_id and input")
        if self.pairs and self.chat_key:
            raise MixtureError(f"{where}: give pairs or chat_key, not both (pairs read prompt/chosen/rejected)")
        if (self.subset or self.revision) and not self.hub_id:
            raise MixtureError(f"{where}: subset and revision need a hub_id")
        if self.held_out is not None and (why := held_out_problem(self.held_out)):
            raise MixtureError(f"{where}: held_out: {why}")
        if self.pairs and self.held_out:  # the split hashes single documents: it would part chosen from rejected
            raise MixtureError(f"{where}: held_out: not for pairs; hold pairs out in a file of their own "
                               "(as assets/preference/held_out)")
        if self.min_doc_tokens is not None and self.min_doc_tokens < 1:
            raise MixtureError(f"{where}: min_doc_tokens must be >= 1, got {self.min_doc_tokens}")
        if (self.concat_by is None) != (self.concat_order is None):
            raise MixtureError(f"{where}: give concat_by and concat_order together (a repository's files need an "
                               "order)")
        if (self.min_doc_tokens or self.concat_by) and (self.pairs or self.chat_key):
            raise MixtureError(f"{where}: min_doc_tokens and concat_by are for text sources, not chat_key or pairs")
        if self.decontaminate:
            from data.decontaminate import DecontaminationError, parse_benchmarks

            try:
                parse_benchmarks(self.decontaminate)
            except DecontaminationError as e:
                raise MixtureError(f"{where}: {e}") from None

    @property
    def origin(self) -> tuple:
        """What the source reads: two sources with the same origin count the same rows twice."""
        return (self.hub_id, self.subset, self.split, self.input, tuple(sorted(
            (k, tuple(sorted(v))) for k, v in self.exclude.items())))


@dataclass(frozen=True)
class SourceNeed:
    """A source's share of the planned run, against its expected size (no data needed)."""

    name: str
    planned_tokens: int  # stream tokens the run reads from it
    max_epochs: float
    expected_tokens: int | None

    @property
    def needs(self) -> int:
        """The fewest tokens the source must hold for the plan to stay within max_epochs."""
        return math.ceil(self.planned_tokens / self.max_epochs)

    @property
    def epochs(self) -> float | None:
        return None if not self.expected_tokens else self.planned_tokens / self.expected_tokens

    @property
    def fits(self) -> bool | None:
        return None if self.expected_tokens is None else self.expected_tokens >= self.needs

    def line(self) -> str:
        size = "expected size unknown (set expected_tokens)" if self.expected_tokens is None else (
            f"expected {self.expected_tokens:,} -> {self.epochs:.2f} epochs of max {self.max_epochs:g}: "
            + ("ok" if self.fits else f"SHORT by {self.needs - self.expected_tokens:,} tokens"))
        return f"  {self.name}: plan {self.planned_tokens:,} tokens, needs >= {self.needs:,} tokens; {size}"


def check_distinct(sources: list[SourceSpec]) -> None:
    """No rows counted twice: two sources may not read the same dataset config, split and filter."""
    seen: dict[tuple, str] = {}
    for s in sources:
        if s.hub_id or s.input:
            if s.origin in seen:
                raise MixtureError(f"sources {seen[s.origin]!r} and {s.name!r} read the same rows "
                                   f"({s.hub_id or s.input}, subset {s.subset}, split {s.split}): keep one")
            seen[s.origin] = s.name


def schedule_counts(sources: list[SourceSpec], seq_len: int, total_samples: int | None,
                    period: int = DEFAULT_PERIOD) -> tuple[np.ndarray, int | None]:
    """Samples per ``period`` for each source (its share of the mixture) and the planned total
    samples (derived from the budgets when only budgets are given). Needs no data."""
    budgets = np.array([s.tokens or 0 for s in sources], dtype=np.float64)
    weights = np.array([s.weight or 0.0 for s in sources], dtype=np.float64)
    has_weights = any(s.weight is not None for s in sources)
    if has_weights and weights.sum() <= 0:
        raise MixtureError(f"weights sum to zero: {[(s.name, s.weight) for s in sources]}")
    if budgets.sum() == 0:
        shares = weights / weights.sum()
    elif not has_weights:  # budgets only: they act as weights, and their sum is the plan by default
        if total_samples is None:
            total_samples = math.ceil(budgets.sum() / seq_len)
        shares = budgets / budgets.sum()
    else:
        if total_samples is None:
            raise MixtureError("token budgets mixed with weights need total_samples")
        total = total_samples * seq_len
        if budgets.sum() > total:
            raise MixtureError(f"token budgets sum to {int(budgets.sum())} > {total} planned tokens")
        shares = budgets / total + (1.0 - budgets.sum() / total) * weights / weights.sum()
    counts = _allocate(shares, period)
    starved = [s.name for s, w, c in zip(sources, shares, counts) if w > 0 and c == 0]
    if starved:
        raise MixtureError(f"sources {starved} get no sample per {period}: raise `period`")
    return counts, total_samples


def samples_per_source(counts: np.ndarray, n: int, slot_source: np.ndarray | None = None) -> np.ndarray:
    """How many of the global samples [0, n) each source provides (exact with ``slot_source``,
    the schedule's slot -> source; else whole periods plus a proportional remainder)."""
    block, slot = divmod(int(n), int(counts.sum()))
    if slot_source is None:
        slot_source = _interleave(counts)[0]
    return block * counts + np.bincount(slot_source[:slot], minlength=len(counts))


def planned_stream_tokens(samples: int, seq_len: int) -> int:
    """Stream tokens ``samples`` windows of one source read (they overlap by one token)."""
    return samples * seq_len + int(samples > 0)


def needs(sources: list[SourceSpec], seq_len: int, total_samples: int) -> list[SourceNeed]:
    """Every source's planned tokens and the size it needs, from the recipe alone."""
    counts, total_samples = schedule_counts(sources, seq_len, total_samples)
    per_source = samples_per_source(counts, total_samples)
    return [SourceNeed(s.name, planned_stream_tokens(int(n), seq_len), s.max_epochs, s.expected_tokens)
            for s, n in zip(sources, per_source)]


@dataclass(frozen=True)
class SourcePlan:
    name: str
    path: str
    share: float  # realized fraction of samples (count per period / period)
    available_tokens: int
    documents: int
    planned_tokens: int | None  # stream tokens the planned run reads (None: no total given)
    epochs: float | None  # planned_tokens / available_tokens


def _seed_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def _allocate(shares: np.ndarray, period: int) -> np.ndarray:
    """Integer counts per source summing to period, largest-remainder rounding of shares * period."""
    exact = shares * period
    counts = np.floor(exact).astype(np.int64)
    assert 0 <= period - counts.sum() <= len(shares), "shares must sum to 1"
    order = np.lexsort((np.arange(len(shares)), -(exact - counts)))  # largest remainder first, ties by index
    counts[order[: period - counts.sum()]] += 1
    return counts


def _interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slot -> source and slot -> index within the source, for one block (smooth round robin)."""
    src = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    times = (rank + 0.5) / np.maximum(counts, 1)[src]
    order = np.lexsort((src, times))
    return src[order], rank[order]


class SourceStream:
    """A source's documents as an endless stream, one seeded permutation per epoch.

    Lengths and permutations come from the source's memory-mapped index (data.index),
    built once per node and shared by the ranks that read it."""

    def __init__(self, source: TokenizedSource, name: str, seed: int, max_epochs: float | None):
        self.source, self.name, self.max_epochs = source, name, max_epochs
        self.shards = [s.tokens for s in source.shards]
        self.masks = [s.loss for s in source.shards] if all(s.loss is not None for s in source.shards) else None
        self.shard_offsets = np.cumsum([0] + [s.num_tokens for s in source.shards], dtype=np.int64)
        self.index = SourceIndex(source)
        self.lens = self.index.lens
        self.num_docs = len(self.lens)
        self.num_tokens = int(self.shard_offsets[-1])
        self.starts_ckpt = self.index.starts  # global start of document j * _CKPT
        self._key = [seed, _seed_key(name)]
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(permutation of documents, stream offset of every _CKPT-th permuted document); the maps of
        the current and previous epoch stay open, as readers move forward (opening one is a file open)."""
        if e not in self._epochs:
            self._epochs[e] = self.index.epoch(self._key, e)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        self._epochs.move_to_end(e)
        return self._epochs[e]

    def doc_start(self, d: int) -> int:
        base = d - d % _CKPT
        return int(self.starts_ckpt[d // _CKPT]) + int(self.lens[base:d].sum(dtype=np.int64))

    def read(self, a: int, n: int, out: np.ndarray, doc_start: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Fill out[:n] with stream tokens [a, a + n); doc_start[j] = True where a document begins."""
        if self.max_epochs is not None and a + n > self.max_epochs * self.num_tokens:
            raise MixtureError(f"source {self.name!r} ({self.source.path}) exhausted: reading token {a + n} of its "
                               f"stream needs more than max_epochs={self.max_epochs} x {self.num_tokens} tokens")
        doc_start[:n] = False
        if mask is not None:  # mask[j] = 1: token j is trained on (every token of a source without masks)
            mask[:n] = 1
        filled = 0
        while filled < n:
            e, o = divmod(a + filled, self.num_tokens)
            perm, ckpt = self.epoch(e)
            c = int(np.searchsorted(ckpt, o, side="right")) - 1
            block_ends = ckpt[c] + np.cumsum(self.lens[perm[c * _CKPT : (c + 1) * _CKPT]], dtype=np.int64)
            i = int(np.searchsorted(block_ends, o, side="right"))
            j = c * _CKPT + i
            off = o - (int(block_ends[i]) - int(self.lens[perm[j]]))  # offset inside document perm[j]
            while filled < n and j < self.num_docs:
                d = int(perm[j])
                take = min(int(self.lens[d]) - off, n - filled)
                g = self.doc_start(d) + off
                s = int(np.searchsorted(self.shard_offsets, g, side="right")) - 1
                local = g - int(self.shard_offsets[s])
                out[filled : filled + take] = self.shards[s][local : local + take]
                if mask is not None and self.masks is not None:
                    mask[filled : filled + take] = self.masks[s][local : local + take]
                doc_start[filled] = off == 0
                filled += take
                off = 0
                j += 1


@dataclass
class Mixture:
    """Validated sources plus the schedule; ``batch(indices)`` materializes global samples.

    expected_fingerprint / expected_vocab_size: the training tokenizer's
    (data.tokenizer.Tokenizer.fingerprint / vocab_size); shards made with
    another tokenizer are refused. total_samples (steps * global batch), when
    given, lets the plan check every source against its max_epochs up front.
    """

    sources: list[SourceSpec]
    seq_len: int
    seed: int = 0
    expected_fingerprint: str | None = None
    expected_vocab_size: int | None = None
    total_samples: int | None = None
    period: int = DEFAULT_PERIOD
    plan: list[SourcePlan] = field(init=False)
    # each source's loss_weight (float32), or None when every source weighs 1 (the token mean)
    loss_weights: np.ndarray | None = field(init=False)

    def __post_init__(self):
        if self.seq_len < 1:
            raise MixtureError(f"seq_len must be >= 1, got {self.seq_len}")
        self.sources = [s if isinstance(s, SourceSpec) else SourceSpec(**s) for s in self.sources]
        self._check_specs()
        opened = [open_source(s.path, self.expected_fingerprint, self.expected_vocab_size) for s in self.sources]
        self.counts, self.total_samples = schedule_counts(self.sources, self.seq_len, self.total_samples, self.period)
        self.slot_source, self.slot_rank = _interleave(self.counts)
        self.streams = [SourceStream(src, spec.name, self.seed, spec.max_epochs)
                        for spec, src in zip(self.sources, opened)]
        self.plan = self._plan(opened)
        weights = np.array([s.loss_weight for s in self.sources], dtype=np.float32)
        self.loss_weights = None if (weights == 1).all() else weights
        over = [(p, s) for p, s in zip(self.plan, self.sources) if p.epochs is not None and p.epochs > s.max_epochs]
        if over:
            raise MixtureError("planned reading exceeds max_epochs: " + "; ".join(
                f"{p.name} ({p.path}): {p.planned_tokens:,} planned tokens / {p.available_tokens:,} available = "
                f"{p.epochs:.3f} epochs > max_epochs={s.max_epochs}" for p, s in over))

    def _check_specs(self) -> None:
        if not self.sources:
            raise MixtureError("no sources")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise MixtureError(f"source names must be unique: {names}")
        check_distinct(self.sources)

    def _plan(self, opened: list[TokenizedSource]) -> list[SourcePlan]:
        per_source = self.samples_per_source(self.total_samples) if self.total_samples else None
        plans = []
        for i, (spec, src) in enumerate(zip(self.sources, opened)):
            planned = None if per_source is None else planned_stream_tokens(int(per_source[i]), self.seq_len)
            plans.append(SourcePlan(spec.name, str(spec.path), float(self.counts[i] / self.period), src.num_tokens,
                                    src.num_documents, planned,
                                    None if planned is None else planned / src.num_tokens))
        return plans

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Global sample indices -> (source, sample index within that source)."""
        block, slot = np.divmod(np.asarray(indices, dtype=np.int64), self.period)
        src = self.slot_source[slot]
        return src, block * self.counts[src] + self.slot_rank[slot]

    def samples_per_source(self, n: int) -> np.ndarray:
        """How many of the global samples [0, n) each source provides."""
        return samples_per_source(self.counts, n, self.slot_source)

    def consumed_tokens(self, n: int, skipped: list[tuple[int, int]] = ()) -> dict[str, int]:
        """Label tokens each source contributed to global samples [0, n) but the ``skipped`` ranges
        [a, b) (a spike rollback's, never trained on), for logging."""
        counts = self.samples_per_source(n)
        for a, b in skipped:
            counts = counts - (self.samples_per_source(b) - self.samples_per_source(a))
        return {s.name: int(c) * self.seq_len for s, c in zip(self.sources, counts)}

    def batch(self, indices) -> dict[str, np.ndarray]:
        """Samples for global indices: input_ids, labels, positions [B, seq_len] int64; source [B]; and
        where sources weigh their tokens (``loss_weights``), loss_weights [B, seq_len] float32: the label's
        source's weight, 0 where the label is IGNORE_INDEX."""
        indices = np.asarray(indices, dtype=np.int64)
        src, k = self.locate(indices)
        L = self.seq_len
        window = np.empty((len(indices), L + 1), dtype=np.int64)
        starts = np.empty((len(indices), L + 1), dtype=bool)
        masks = np.ones((len(indices), L + 1), dtype=np.uint8)
        for b in range(len(indices)):
            self.streams[src[b]].read(int(k[b]) * L, L + 1, window[b], starts[b], masks[b])
        idx = np.broadcast_to(np.arange(L), (len(indices), L))
        seg = np.maximum.accumulate(np.where(starts[:, :L], idx, 0), axis=1)
        labels = np.where(masks[:, 1:] == 1, window[:, 1:], IGNORE_INDEX)
        batch = {"input_ids": np.ascontiguousarray(window[:, :L]), "labels": labels,
                 "positions": idx - seg, "source": src}
        if self.loss_weights is not None:
            batch[LOSS_WEIGHTS] = np.where(labels != IGNORE_INDEX, self.loss_weights[src][:, None], 0).astype(np.float32)
        return batch

    def describe(self) -> str:
        lines = [f"mixture: seq_len={self.seq_len} seed={self.seed} total_samples={self.total_samples}"]
        for p, s in zip(self.plan, self.sources):
            planned = "" if p.planned_tokens is None else f", plan {p.planned_tokens:,} tokens = {p.epochs:.3f} epochs"
            weight = "" if s.loss_weight == 1 else f", loss weight {s.loss_weight:g}"
            lines.append(f"  {p.name}: share {p.share:.4f}, {p.available_tokens:,} tokens / {p.documents:,} docs"
                         f"{planned}{weight} ({p.path})")
        return "\n".join(lines)


class MixtureLoader:
    """One data-parallel rank's batches: rank r reads global indices next + r * B/W + j."""

    def __init__(self, mixture: Mixture, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 next_index: int = 0):
        if global_batch_size % world_size:
            raise MixtureError(f"global batch {global_batch_size} is not divisible by world size {world_size}")
        if not 0 <= rank < world_size:
            raise MixtureError(f"rank {rank} outside world size {world_size}")
        self.mixture, self.global_batch_size, self.rank, self.world_size = mixture, global_batch_size, rank, world_size
        self.local_batch_size = global_batch_size // world_size
        self.next_index = next_index
        self.skipped: list[tuple[int, int]] = []  # global sample ranges [a, b) left unread: skip_to

    def indices(self) -> np.ndarray:
        """Global sample indices of this rank's next batch."""
        first = self.next_index + self.rank * self.local_batch_size
        return np.arange(first, first + self.local_batch_size, dtype=np.int64)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.mixture.batch(self.indices())
        self.next_index += self.global_batch_size
        return batch

    def skip_to(self, index: int) -> tuple[int, int]:
        """Go on from global sample ``index``, leaving [next_index, index) unread: a spike rollback
        (health.rollback) skips the batches seen between its checkpoint and the spikes. Skipped
        samples are not counted as consumed; returns the range."""
        skipped = (self.next_index, int(index))
        self.skipped.append(skipped)
        self.next_index = int(index)
        return skipped

    def state_dict(self) -> dict:
        """The same on every rank: resumable on any world size."""
        m = self.mixture
        # skipped: one JSON string (DCP stores it as an opaque object), always present: DCP loads only
        # the keys of the state it loads into, which is a fresh loader's.
        return {"next_index": self.next_index, "seq_len": m.seq_len, "seed": m.seed,
                "consumed_tokens": m.consumed_tokens(self.next_index, self.skipped),
                "skipped": json.dumps(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        m = self.mixture
        if state["seq_len"] != m.seq_len or state["seed"] != m.seed:
            raise MixtureError(f"checkpoint was written with seq_len={state['seq_len']} seed={state['seed']}, "
                               f"this mixture has seq_len={m.seq_len} seed={m.seed}")
        self.next_index = int(state["next_index"])
        self.skipped = [tuple(r) for r in json.loads(state.get("skipped", "[]"))]
