"""Held-out loss by position in the document: ``eval/val_loss_pos/<start>-<end>``.

Why: a model extended past the length it was trained at either uses the new context or ignores it,
and its loss by position shows which before any benchmark does: a model that ignores what lies
beyond 4k has a loss that stops falling (or climbs) past 4k.

A token's position is the one the model is given for it: data.mixture's ``positions``, which
restart at 0 at every document and at the start of every row (the document mask keeps attention
inside the piece), so it is the number of tokens the model could see before it. Bucket ``[start,
end)`` holds the scored tokens (labels not IGNORE_INDEX) whose position falls in it; only the tokens
that reach a bucket count (a short document adds to the first buckets only), and its loss is their
mean. A bucket no token reached is left out. The buckets are equal parts of the length scored, to
a token (edges ``i * length // buckets``, any count up to the length): each gets the same share of a
long document, so their noise is alike, and with a bucket count that is a multiple of the extension
factor (8 buckets of 16k) an edge falls on the old length.

Ranks add up (nats, tokens) per bucket and divide once: the same means on any number of ranks.

One module for the training eval callback (train.callbacks.eval, on the training model, whose
document mask takes the positions) and ``python -m eval.run --loss-by-position`` (a checkpoint or an
export, which has no document mask: each document piece is scored as a row of its own, which is the
same thing). The names are read by the torch-free run report (through train.metric_names), so torch
is imported by the functions that compute, not here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.mixture import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

    from data.mixture import Mixture

VAL_LOSS_POS = "eval/val_loss_pos"


def position_metric(start: int, end: int) -> str:
    """The loss of the tokens at positions [start, end): ``eval/val_loss_pos/<start>-<end>``."""
    return f"{VAL_LOSS_POS}/{start}-{end}"


def bucket_of(key: str) -> tuple[int, int] | None:
    """``(start, end)`` of a position_metric name; None for any other metric."""
    head, _, span = key.rpartition("/")
    start, _, end = span.partition("-")
    return (int(start), int(end)) if head == VAL_LOSS_POS and start.isdigit() and end.isdigit() else None


def bucket_edges(length: int, buckets: int) -> list[int]:
    """``buckets`` equal parts of [0, length), to a token: their edges, ``buckets + 1`` integers from 0 to length."""
    if not 0 < buckets <= length:
        raise ValueError(f"position_buckets: {buckets} buckets of a length of {length}: must be in [1, {length}]")
    return [i * length // buckets for i in range(buckets + 1)]


def validation_rows(val_samples: int, micro: int, world: int, rank: int) -> list[np.ndarray]:
    """``rank``'s rows of a held-out set, batch by batch: samples 0 .. val_samples - 1 dealt out
    ``micro`` to a rank in turn, -1 for a padding row. Every rank runs as many forwards of ``micro``
    rows as the busiest (FSDP gathers its weights in every forward; a compiled model keeps one shape),
    so rows past val_samples are padding, left out of the loss: the scored samples, and so the loss,
    are the same on any number of ranks and any micro batch."""
    per_step = world * micro
    rows = [b * per_step + rank * micro + np.arange(micro) for b in range(math.ceil(val_samples / per_step))]
    return [np.where(r < val_samples, r, -1) for r in rows]


def token_nats(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each token's loss in nats ``[B, S]`` from float32 logits (as the training loss), 0 where the label
    is IGNORE_INDEX."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none",
                           ignore_index=IGNORE_INDEX).view(labels.shape)


def bucket_sums(nats: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                edges: Sequence[int]) -> torch.Tensor:
    """``[2, buckets]`` float64 on the CPU: the nats and the count of the scored tokens whose position
    falls in each bucket (tensors ``[B, S]``, labels as the loss sees them)."""
    import torch

    kept = (labels != IGNORE_INDEX).cpu()
    bucket = torch.bucketize(positions.cpu()[kept], torch.tensor(edges[1:-1]), right=True)
    sums = torch.zeros(2, len(edges) - 1, dtype=torch.float64)
    sums[0].index_add_(0, bucket, nats.detach().cpu()[kept].double())
    sums[1].index_add_(0, bucket, torch.ones(len(bucket), dtype=torch.float64))
    return sums


def bucket_losses(sums: torch.Tensor, edges: Sequence[int]) -> dict[str, float]:
    """Each bucket's mean loss (its sums, added over every rank and set), named; a bucket that no token
    reached has no number (not a NaN that a plot or a mean would carry)."""
    return {position_metric(a, b): nats / tokens for (a, b), (nats, tokens) in zip(pairwise(edges), sums.T.tolist())
            if tokens}


def pieces(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document piece in packed rows: a piece starts where its position is 0."""
    out = []
    for b, row in enumerate(positions.tolist()):
        starts = [i for i, p in enumerate(row) if p == 0]
        out += [(b, s, e) for s, e in zip(starts, [*starts[1:], len(row)])]
    return out


def unpacked_logits(model_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, S, V]`` of packed rows from a model that takes no positions (an HF export): each
    document piece runs as a row of its own from position 0, which is what the training model's
    document mask and restarted positions make of it. Pieces run longest first, padded on the right
    (after every real token: causal attention never shows it to one), about ``B x S`` tokens a forward."""
    todo = sorted(pieces(positions), key=lambda p: p[1] - p[2])
    logits = None
    while todo:
        width = todo[0][2] - todo[0][1]
        chunk, todo = todo[:max(1, ids.numel() // width)], todo[max(1, ids.numel() // width):]
        batch = ids.new_zeros(len(chunk), width)
        for j, (b, s, e) in enumerate(chunk):
            batch[j, :e - s] = ids[b, s:e]
        out = model_fn(batch)
        logits = out.new_empty(*ids.shape, out.shape[-1]) if logits is None else logits
        for j, (b, s, e) in enumerate(chunk):
            logits[b, s:e] = out[j, :e - s]
    assert logits is not None, "a row has at least one piece"
    return logits


def held_out_sets(entries: Sequence[str]) -> dict[str, str]:
    """``eval.run --held-out [NAME=]DIR,...``: each set's name -> its folder of tokenized documents.

    DIR is a source split by data.held_out (its ``held_out/`` is read) or a tokenized folder of held-out
    documents itself (a ``held_out/`` folder, an ``[eval] val_sources`` dir). A set's name seeds its
    document order (data.mixture), so its rows are a run's when it is named as the run names it
    (train.recipe.checks.validation_sets): a split source by the recipe's source name (default: the
    source's folder name), a tokenized folder by its folder name. Raises ValueError naming --held-out.
    """
    from data.held_out import held_out_dir
    from data.shards import MANIFEST

    sets: dict[str, str] = {}
    for entry in entries:
        name, _, path = entry.rpartition("=")
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"--held-out {entry}: {folder}: no such folder")
        if (held_out_dir(folder) / MANIFEST).is_file():
            found = held_out_dir(folder)
        elif (folder / MANIFEST).is_file():
            found = folder
        else:
            raise ValueError(f"--held-out {entry}: {folder} holds neither held_out/{MANIFEST} (a source split by "
                             f"python -m data.held_out) nor a {MANIFEST} (a tokenized folder)")
        name = name or folder.resolve().name
        if name in sets:
            raise ValueError(f"--held-out: two sets named {name!r} ({sets[name]}, {found}): name them NAME=DIR")
        sets[name] = str(found)
    return sets


def held_out_mixtures(sets: dict[str, str], seq_len: int, tokenizer) -> list[Mixture]:
    """Each held-out set as rows of ``seq_len``, as the training loop reads it (train.callbacks.eval:
    a one-source mixture of seed 0, from its start), refused if tokenized with another tokenizer than
    ``tokenizer`` (its fingerprint, when it has one, and its size). Raises ValueError naming --held-out."""
    from data.mixture import Mixture, SourceSpec

    out = []
    for name, path in sets.items():
        try:
            out.append(Mixture([SourceSpec(name=name, path=path, weight=1.0, max_epochs=1e9)], seq_len, seed=0,
                               expected_fingerprint=getattr(tokenizer, "fingerprint", None),
                               expected_vocab_size=tokenizer.vocab_size))
        except ValueError as e:
            raise ValueError(f"--held-out {name}={path}: {e}") from None
    return out


def loss_by_position(model_fn: Callable[[torch.Tensor], torch.Tensor], mixtures: Sequence[Mixture], samples: int,
                     edges: Sequence[int], device: torch.device | str) -> dict[str, float]:
    """``python -m eval.run --loss-by-position``: the first ``samples`` rows of each held-out set (a
    Mixture at the length scored), dealt out to the ranks as the loop deals them, each row's pieces
    scored apart (unpacked_logits), summed over the sets and ranks: the loop's numbers for those rows."""
    import torch

    from . import dist

    sums = torch.zeros(2, len(edges) - 1, dtype=torch.float64)
    with torch.no_grad():
        for mixture in mixtures:
            for rows in validation_rows(samples, 1, dist.world_size(), dist.rank()):
                if rows[0] < 0:  # padding: eval.run's ranks run no FSDP, so none waits for this forward
                    continue
                batch = {k: torch.from_numpy(v) for k, v in mixture.batch(rows).items()}
                logits = unpacked_logits(model_fn, batch["input_ids"].to(device), batch["positions"])
                nats = token_nats(logits, batch["labels"].to(device))
                sums += bucket_sums(nats, batch["labels"], batch["positions"], edges)
    return bucket_losses(dist.all_reduce_sum(sums.to(device)).cpu(), edges)
